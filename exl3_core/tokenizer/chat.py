"""Chat-template rendering with the semantics of HF transformers' ``apply_chat_template``.

Templates ship with checkpoints and are untrusted code, so they run in jinja2's immutable sandbox.
The environment matches transformers': ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block tag (rendered as its body), ``raise_exception``,
``strftime_now``, a ``tojson`` that does not HTML-escape and takes ``indent``/``separators``/
``sort_keys``/``ensure_ascii``, and a ``namespace`` that refuses underscore attributes. Inputs are
rebuilt from plain JSON types before the template sees them, and ``None``-valued message keys are
dropped (templates handle a missing key better than a literal ``None``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

#: Names a message's reasoning is passed under; templates read the first, older ones use the others.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template is missing, ambiguous or raised ``raise_exception``."""


def _plain(value: Any) -> Any:
    """A copy of ``value`` built only from JSON types; other objects become ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy / torch scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for m in _plain(list(conversation)):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"chat messages must be dicts (or dataclasses / pydantic models), got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


#: roles every chat template is taken to render: OpenAI's conversation roles
BASE_ROLES = frozenset({"system", "user", "assistant"})


@functools.lru_cache(maxsize=16)
def template_roles(source: str) -> frozenset[str]:
    """The roles a template knows: :data:`BASE_ROLES` plus every string it compares a role with
    (``message['role'] == 'tool'``, ``message.role in ['ipython', 'tool']``, ``role != 'developer'``).
    A role outside this set would be pasted into the prompt verbatim, where a template that only
    prints ``message['role']`` turns any string into a turn header."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = _environment().parse(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e

    def is_role(n: nodes.Node) -> bool:
        if isinstance(n, nodes.Getitem):
            return isinstance(n.arg, nodes.Const) and n.arg.value == "role"
        if isinstance(n, nodes.Getattr):
            return n.attr == "role"
        return isinstance(n, nodes.Name) and n.name == "role"

    def strings(n: nodes.Node) -> list[str]:
        if isinstance(n, nodes.Const) and isinstance(n.value, str):
            return [n.value]
        if isinstance(n, (nodes.Tuple, nodes.List)):
            return [s for item in n.items for s in strings(item)]
        return []

    roles = set(BASE_ROLES)
    for cmp in tree.find_all(nodes.Compare):
        operands = [cmp.expr] + [op.expr for op in cmp.ops]
        if any(is_role(o) for o in operands):
            roles.update(s for o in operands for s in strings(o))
    return frozenset(r for r in roles if r)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """Compile ``source`` in the sandboxed environment (cached per template text)."""
    return _environment().from_string(source)


@functools.lru_cache(maxsize=1)
def _environment() -> Any:
    """The sandboxed jinja2 environment templates run in (built once)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text; rendering keeps the body."""

        tags = {"generation"}  # noqa: RUF012 - jinja2 declares it as a plain class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt prompts.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        # dict() without exposing the dict type itself to attribute tricks
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Underscore attributes could reach interpreter internals; refuse to store them.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not store underscore attributes on a namespace ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def select_template(chat_template: str | Mapping[str, str] | None, name: str | None = None,
                    tools: Sequence[Any] | None = None) -> str:
    """Pick the template text: a single template, or from named ones (``tool_use`` when tools are
    given and it exists, else ``default``); ``name`` may also be a literal template."""
    if isinstance(chat_template, Mapping):
        if name is not None and name in chat_template:
            return chat_template[name]
        if name is not None:
            return name
        if tools is not None and "tool_use" in chat_template:
            return chat_template["tool_use"]
        if "default" in chat_template:
            return chat_template["default"]
        raise ChatTemplateError(f"the tokenizer has several chat templates and none is 'default'; pass one of "
                                f"{sorted(chat_template)} as chat_template=")
    if name is not None:
        return name
    if chat_template is None:
        raise ChatTemplateError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                                "chat_template.jinja); pass chat_template= explicitly")
    return chat_template


def render(template: str, messages: Sequence[Any], *, add_generation_prompt: bool = True,
           tools: Sequence[Mapping[str, Any]] | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
           special_tokens: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """Render one conversation. ``special_tokens`` (bos_token, eos_token, ...) are template
    variables that ``kwargs`` may override, as in transformers."""
    import jinja2

    if tools is not None:
        for t in tools:
            if not isinstance(t, Mapping):
                raise ChatTemplateError(f"tools must be JSON-schema dicts, got {type(t).__name__}")
    if documents is not None:
        for d in documents:
            if not isinstance(d, Mapping):
                raise ChatTemplateError("documents must be dicts with 'title' and 'text' keys")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return str(compile_template(template).render(
            messages=_messages(messages), tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain(variables)))
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
