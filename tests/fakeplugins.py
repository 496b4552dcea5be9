"""Throwaway plugins for discovery tests, as objects or as installed distributions."""

from __future__ import annotations

import textwrap
from pathlib import Path

from llmcore import hookimpl
from llmcore.records import Backend, QuantizerRecipe

CALLS: list[str] = []


class RecordingPartitioner:
    """A real ExecuTorch partitioner that tags nothing and records when it was asked."""

    def __new__(cls, name: str):
        from executorch.exir.backend.partitioner import PartitionResult, Partitioner

        class _Impl(Partitioner):
            def __init__(self):
                super().__init__()
                self.name = name

            def partition(self, exported_program):
                CALLS.append(self.name)
                return PartitionResult(tagged_exported_program=exported_program, partition_tags={})

        return _Impl()


class BackendPlugin:
    """A plugin object providing one backend called ``name``."""

    def __init__(self, name: str):
        self.name = name

    @hookimpl
    def llmcore_partitioners(self):
        return [Backend(name=self.name, description=f"fake {self.name}",
                        partitioners=lambda options: [RecordingPartitioner(self.name)])]


class RecipePlugin:
    def __init__(self, name: str):
        self.name = name

    @hookimpl
    def llmcore_quantizers(self):
        return [QuantizerRecipe(name=self.name, description="fake", source_quantize=lambda m, o: m)]


class BadHookPlugin:
    @hookimpl
    def llmcore_partitioners(self):
        return [{"name": "not-a-record"}]


class MisspeltHookPlugin:
    """A backend whose hook name has a typo (``llmcore_partitioner``), beside a valid hook."""

    @hookimpl
    def llmcore_partitioner(self):
        return [Backend(name="typo", description="never seen", partitioners=lambda options: [])]

    @hookimpl
    def llmcore_quantizers(self):
        return [QuantizerRecipe(name="typo-recipe", description="fake", source_quantize=lambda m, o: m)]


class BadNamePlugin:
    """A backend named with a comma, which ``--plugins a,b`` could never select."""

    @hookimpl
    def llmcore_partitioners(self):
        return [Backend(name="my,backend", description="fake", partitioners=lambda options: [])]


def install_fake_distribution(site: Path, dist: str, entry_name: str, module: str, source: str) -> None:
    """Write a minimal installed distribution (dist-info + module) into ``site``."""
    info = site / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[llmcore]\n{entry_name} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))
