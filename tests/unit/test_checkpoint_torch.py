"""The tree a stateful checkpoint leaf's state_dict is saved as
(``mpistrat.checkpoint._torch``): what ``expand`` writes comes back by ``decode`` as it was,
and ``decode`` accepts nothing else (untrusted input), always with a ValueError; and
``import mpistrat.checkpoint`` imports no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpistrat.checkpoint import _torch  # noqa: E402


def test_an_optimizer_state_round_trips_with_int_keys_tuples_and_odd_floats():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.95))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0]["odd"] = [float("inf"), float("nan"), None, "x", True]
    tree, arrays = _torch.expand(optimizer, "opt")
    tree = json.loads(json.dumps(tree))  # what a manifest holds
    state = _torch.decode(tree, len(arrays), lambda i: _torch.to_tensor(arrays[i]))
    original = optimizer.state_dict()
    assert set(state["state"]) == {0, 1}
    assert state["param_groups"][0]["betas"] == (0.8, 0.95)
    odd = state["param_groups"][0]["odd"]
    assert odd[0] == math.inf and math.isnan(odd[1]) and odd[2:] == [None, "x", True]
    for key in (0, 1):
        for name, value in original["state"][key].items():
            assert torch.equal(state["state"][key][name], value)


def test_bfloat16_tensors_keep_their_bits():
    tensor = torch.randn(4, 5).to(torch.bfloat16)
    value = _torch.host_value(tensor)
    assert value.dtype.name == "bfloat16"
    back = torch.zeros(4, 5, dtype=torch.bfloat16)
    _torch.assign(back, np.array(value))
    assert torch.equal(back.view(torch.int16), tensor.view(torch.int16))


def test_a_state_dict_of_other_objects_is_refused_naming_the_place():
    class Odd:
        def state_dict(self):
            return {"a": {"b": object()}}

    with pytest.raises(TypeError, match=r"holds a object at /a/b"):
        _torch.expand(Odd(), "odd")


@pytest.mark.parametrize("tree, count, message", [
    ({"T": 1}, 1, "not one of its 1 arrays"),
    ({"l": [{"T": 0}, {"T": 0}]}, 1, "named twice"),
    ({"T": True}, 1, "not one of its"),
    ({"l": []}, 1, "leaves array 0 unused"),
    ({"x": 1}, 0, "not a value of the tree grammar"),
    ([1, 2], 0, "not a value of the tree grammar"),
    ({"d": [[{"l": []}, 1]]}, 0, "not a unique plain value"),
    ({"d": [["a", 1], ["a", 2]]}, 0, "not a unique plain value"),
    ({"d": [["a"]]}, 0, "dict item"),
    ({"f": "1e400"}, 0, "the float"),
    ({"T": 0, "l": []}, 1, "not a value of the tree grammar"),
    (json.loads('{"l":[' * 100 + "]}" * 100), 0, "nests deeper"),
])
def test_decode_refuses_what_expand_never_writes(tree, count, message):
    with pytest.raises(ValueError, match=message):
        _torch.decode(tree, count, lambda i: i)


def test_a_module_that_does_not_fit_is_named():
    model = torch.nn.Linear(3, 2)
    tree, arrays = _torch.expand(torch.nn.Linear(4, 2), "m")
    state = _torch.decode(tree, len(arrays), lambda i: arrays[i])
    with pytest.raises(ValueError, match=r"weight holds float32 of shape \[2, 4\]"):
        _torch.check_fits(model, "m", state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not an optimizer's state"):
        _torch.check_fits(optimizer, "o", {"state": {}, "param_groups": [{}]})
    with pytest.raises(ValueError, match="groups of \\[1\\] parameters"):
        _torch.check_fits(optimizer, "o", {"state": {}, "param_groups": [{"params": [0]}]})
    with pytest.raises(ValueError, match="other than integers"):
        _torch.check_fits(optimizer, "o", {"state": {},
                                           "param_groups": [{"params": [[0], 1]}]})


def test_importing_the_checkpoints_imports_no_torch():
    code = ("import sys, numpy as np, mpistrat, mpistrat.checkpoint as c\n"
            "ck = c.Checkpoint(w=np.zeros(2), s=c.Scalar(1)); ck._signature(); ck._collect()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
