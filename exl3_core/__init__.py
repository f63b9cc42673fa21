"""exl3: fast EXL3-quantized LLM inference on NVIDIA GPUs.

The public facade. Names resolve lazily (PEP 562) so ``import exl3_core`` stays cheap and plugins
can import :data:`hookimpl` without pulling in torch-heavy modules::

    from exl3_core import Config, Model, Cache, Tokenizer, Generator

    config = Config.from_directory("/models/my-model-exl3")
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=8192)
    model.load(device="cuda:0", progressbar=True, caches=[cache])
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    print(generator.generate(prompt="Once upon a time", max_new_tokens=100))
"""
from __future__ import annotations

__version__ = "0.1.0"

from exl3_core.lazy import lazy_attributes

# re-exported (the `as` form marks them public); light: pluggy only
from exl3_core.plugins import get_plugins as get_plugins
from exl3_core.plugins import hookimpl as hookimpl
from exl3_core.plugins import load_plugins as load_plugins

#: public name -> "module:attribute" (resolved on first access)
_LAZY: dict[str, str] = {
    "Config": "exl3_core.archkit.config:Config",
    "Model": "exl3_core.archkit.model:Model",
    "Tokenizer": "exl3_core.tokenizer:Tokenizer",
    "Cache": "exl3_core.cache:Cache",
    "Generator": "exl3_core.generator:Generator",
    "Job": "exl3_core.generator:Job",
    "AsyncGenerator": "exl3_core.generator:AsyncGenerator",
    "AsyncJob": "exl3_core.generator:AsyncJob",
    "Sampler": "exl3_core.sampling:Sampler",
    "SamplingStep": "exl3_core.sampling:SamplingStep",
    "Filter": "exl3_core.filters:Filter",
    "BatchMeta": "exl3_core.archkit.batch:BatchMeta",
    "AttnSpec": "exl3_core.attention:AttnSpec",
    "AttnArgs": "exl3_core.attention:AttnArgs",
}

__all__ = sorted(["__version__", "get_plugins", "hookimpl", "load_plugins", *_LAZY])


__getattr__ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return __all__
