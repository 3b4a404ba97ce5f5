"""vllm_hisparse: hierarchical (GPU + pinned host) KV-cache residency for top-k sparse attention.

Importing the package has no side effects: nothing is registered with vLLM and no
extension is loaded until a submodule asks for it.
"""

#: The package version, written only here: pyproject.toml reads it (scikit-build-core's regex
#: metadata provider), so the wheel, ``pip show`` and the plugin's startup line agree.
__version__ = "0.1.0.dev0"
