"""SGLang's ``/weights_checker`` on the torch engine (``--check-weight-update-equal``): a snapshot, noise
over every parameter, then a push of the checkpoint must compare equal again."""

from __future__ import annotations

import pytest

from tests.support.served_engine import ServedEngine
from tools.make_tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2")
    server = ServedEngine(["--model-path", str(model)])
    yield server, model
    server.close()


def test_reset_weights_compare_unequal_until_the_checkpoint_is_pushed_again(served) -> None:
    server, model = served
    assert server.post("/weights_checker", {"action": "snapshot"}).json() == {
        "success": True,
        "message": "Success.",
    }
    assert server.post("/weights_checker", {"action": "compare"}).status_code == 200
    assert server.post("/weights_checker", {"action": "reset_tensors"}).status_code == 200
    refused = server.post("/weights_checker", {"action": "compare"})
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert refused.json()["message"].startswith("check tensor equality failed:\nname=model.")
    pushed = server.post("/update_weights_from_disk", {"model_path": str(model), "weight_version": "2"})
    assert pushed.status_code == 200, pushed.text
    assert server.post("/weights_checker", {"action": "compare"}).json()["success"] is True
    skipped = server.post("/weights_checker", {"action": "compare", "skip_tensor_list": ["model."]})
    assert skipped.status_code == 200
    unknown = server.post("/weights_checker", {"action": "checksum"})
    assert unknown.status_code == 400 and "Unsupported action='checksum'" in unknown.json()["message"]
