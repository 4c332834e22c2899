"""The operator never pulls in the runtime stack (torch, vLLM, Ray), so its image stays small."""

import subprocess
import sys


def _loaded_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print(' '.join(sorted({{k.split('.')[0] for k in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_operator_does_not_import_runtime_stack() -> None:
    loaded = _loaded_after("import rlhf_operator.handlers, rlhf_operator.main")
    assert not loaded & {"torch", "vllm", "ray", "transformers", "rlhf_runtime"}, loaded & {"torch", "vllm", "ray"}
    assert "kopf" in loaded


def test_api_imports_neither_side() -> None:
    loaded = _loaded_after("import rlhf_api.models, rlhf_api.crdgen")
    assert not loaded & {"torch", "vllm", "ray", "kopf", "kubernetes"}


def test_storage_is_torch_free() -> None:
    """Object-store checkpoints (``infra.storage``) import without torch, Ray or vLLM (the driver and tools use it)."""
    loaded = _loaded_after("import rlhf_runtime.infra.storage")
    assert not loaded & {"torch", "vllm", "ray", "transformers", "obstore"}, loaded
