"""Fault specs a model can not have run are refused at load, in one sentence naming the field.

If a test here fails, a profile with a NaN rate or error size, a negative lane, a bit past the
widest dtype, or layers, lanes or tp ranks the model lacks was accepted: it would inject NaNs,
or never fire while the run reports a faulty node. Nothing here compiles a JAX program.
"""

import math

import pytest

from sdcstudy.core import config as C
from sdcstudy.core.errors import UserError
from sdcstudy.faults import profiles
from sdcstudy.faults.profile_yaml import spec_from_dict
from sdcstudy.faults.specs import FaultSpecError

BASE = {"site": "fwd/attn", "kind": "bitflip", "rate": 1e-3}


@pytest.mark.parametrize("field, value, named", [
    ("rate", math.nan, "rate"),
    ("rate", 1.5, "rate"),
    ("value_std", math.nan, "value_std"),
    ("lanes", [-5], "lanes"),
    ("bits", [40], "bits"),
    ("pattern", {"kind": "decay", "decay_steps": 0}, "decay_steps"),
])
def test_a_spec_field_out_of_range_is_one_sentence_naming_it(field, value, named):
    with pytest.raises(FaultSpecError) as refused:
        spec_from_dict({**BASE, field: value}, "profile x, spec 1")
    message = str(refused.value)
    assert named in message and "\n" not in message and message.startswith("profile x")


def test_a_spec_in_range_loads():
    """The refusals above are about the values, not the fields (a control that must pass)."""
    spec = spec_from_dict({**BASE, "lanes": [3], "bits": [30]}, "profile x, spec 1")
    assert spec.lanes == (3,) and spec.bits == (30,)


def _profile(tmp_path, **fields):
    path = tmp_path / "profile.yaml"
    spec = "".join(f"    {k}: {v}\n" for k, v in {**BASE, **fields}.items())
    path.write_text(f"name: x\nspecs:\n  - site: {BASE['site']}\n"
                    + "".join(line for line in spec.splitlines(True) if "site:" not in line))
    return path


@pytest.mark.parametrize("fields, named", [
    ({"layers": "[99]"}, "layers"),
    ({"lanes": "[100000]"}, "lanes"),
    ({"tp_ranks": "[2]"}, "tp"),
])
def test_a_profile_naming_what_the_model_lacks_is_refused_for_that_model(tmp_path, fields,
                                                                          named):
    path = _profile(tmp_path, **fields)
    cfg = C.load("configs/tiny.yaml", [f"suspect.profile={path}", "mesh.tp=1"])
    with pytest.raises(UserError) as refused:
        profiles.load_for(cfg)
    message = str(refused.value)
    assert message.startswith("suspect.profile") and named in message and "\n" not in message
    profiles.load(str(path))  # the file alone is valid: only this model lacks what it names
