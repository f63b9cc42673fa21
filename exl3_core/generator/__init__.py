"""Generation: jobs, continuous-batching generator, async wrapper."""
from __future__ import annotations

from exl3_core.generator.async_generator import AsyncGenerator, AsyncJob
from exl3_core.generator.generator import Generator, JobError
from exl3_core.generator.job import Job
from exl3_core.generator.types import NumericFault

__all__ = ["AsyncGenerator", "AsyncJob", "Generator", "Job", "JobError", "NumericFault"]
