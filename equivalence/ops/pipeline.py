"""A pipeline op as a Spec: forward_mqa and its multi-process DCP form call many stages.

Its subject is the project's pipeline with any stage replaced (`STAGE=NAME`,
`STAGE=MODULE:CALLABLE`, or a registered `NAME` in every stage that has one), or a user's whole
function (`MODULE:CALLABLE`, with the op's keyword arguments). It may have paths (`--path`) the
fuzzer can be held to, and world sizes it runs over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from hypothesis import strategies as st

from mla_verify.optimized import registry

from ..builders import stamped
from ..case import Case
from ..draws import SEEDS
from ..profiles import Profile
from ..subject import Subject, UsageError, pipeline_subject
from .base import OpSpec

# On a GPU a pipeline is checked twice: with the preferred stages (flash_mla attention) and with
# our Triton attention kernels in their place.
VARIANTS = {"pipeline": (), "pipeline[triton attention]": ("sparse_prefill=triton", "sparse_decode_fp8=triton")}


@dataclass(frozen=True)
class PipelineSpec(OpSpec):
    paths: tuple[str, ...] = ()            # what --path may hold the draw to
    own_campaigns: tuple[str, ...] = ()    # paths the gate fuzzes apart: the unrestricted draw never takes them
    draw_path: Callable[[Profile, str], st.SearchStrategy[dict]] | None = None
    draw_ranks: Callable[[Profile, int], st.SearchStrategy[dict]] | None = None

    def strategy(self, profile: Profile, path: str | None = None, world_size: int | None = None) -> st.SearchStrategy[Case]:
        if path is not None:
            if path not in self.paths:
                raise KeyError(f"{self.name} has no path {path!r}; paths: {', '.join(self.paths) or 'none'}")
            params = self.draw_path(profile, path)
        elif world_size is not None:
            if world_size not in self.ranks:
                raise KeyError(f"{self.name} runs world sizes {', '.join(map(str, self.ranks)) or 'none'}, not {world_size}")
            params = self.draw_ranks(profile, world_size)
        else:
            params = self.draw(profile)
        return st.builds(lambda p, seed: Case(self.name, stamped(self.params, p), seed), params, SEEDS)

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        return pipeline_subject(self.name, specs, device, deviations)

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        if device == "cuda" and registry.select("sparse_prefill", device).name != "triton":
            return dict(VARIANTS)
        return {"pipeline": ()}

    def campaigns(self, subject: Subject) -> list[str | None]:
        return [None] if subject.fn is not None else [None, *self.own_campaigns]

    def path_for(self, path: str | None, subject: Subject) -> str | None:
        if path is not None and path not in self.paths:
            raise UsageError(f"--path applies to --op {self.name} with one of {', '.join(self.paths)}"
                             if self.paths else f"--path: {self.name} has no paths")
        return path
