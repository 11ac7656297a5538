"""PAFT settings that cannot work end in one sentence naming the key (sdcstudy/paft/checks.py).

If a case here fails, `check_config` lets a setting through that the step can not run (or
refuses one it can), or its sentence no longer names the key the user has to change.
"""

import pytest

from sdcstudy.core import config as C
from sdcstudy.core.config import UserError
from sdcstudy.paft.checks import cache_warning, check_config

GOOD = ["experiment.mode=paft", "mesh.dp=4", "paft.noise.sigma2=1e-3", "paft.sync_every=4"]


def test_a_working_setup_passes():
    check_config(C.from_dict({}, GOOD))
    check_config(C.from_dict({}, GOOD + ["paft.loss.p=0.2", "paft.loss.burst=4",
                                         "paft.loss.param_p=0.1", "paft.dynamic=true"]))


@pytest.mark.parametrize("override, sentence", [
    ("mesh.dp=1", "paft mode needs at least 2 workers (mesh.dp), not 1."),
    ("mesh.tp=2", "paft mode runs data-parallel workers only; set mesh.tp=1."),
    ("paft.noise.sigma2=-1", "paft.noise.sigma2 must be non-negative."),
    ("paft.noise.large_sigma2=-1", "paft.noise.large_sigma2 must be non-negative."),
    ("paft.noise.large_every=-1", "paft.noise.large_every must be non-negative."),
    ("paft.sync_every=-1", "paft.sync_every must be non-negative."),
    ("paft.div_every=-1", "paft.div_every must be non-negative."),
    ("paft.h_min=0", "paft.h_min must be at least 1."),
    ("paft.h_max=0", "paft.h_max must be at least paft.h_min."),
    ("paft.loss.p=1", "paft.loss.p must be in [0, 1)."),
    ("paft.loss.param_p=-0.1", "paft.loss.param_p must be in [0, 1) or null."),
    ("paft.loss.packet_size=0", "paft.loss.packet_size must be at least 1."),
    ("paft.loss.burst=0.5", "paft.loss.burst must be 0 (independent drops) or a mean run "
                            "length of at least 1 packet."),
    ("paft.loss.aggregate=mean", "paft.loss.aggregate 'mean' is not one of renormalized, "
                                 "zero, stale."),
])
def test_each_impossible_setting_is_one_sentence(override, sentence):
    with pytest.raises(UserError) as error:
        check_config(C.from_dict({}, GOOD + [override]))
    assert str(error.value) == sentence


STALE = GOOD + ["paft.loss.p=0.3", "paft.loss.aggregate=stale"]


@pytest.mark.parametrize("overrides, backend, cache_on, warned", [
    (STALE, "cpu", True, True),
    (STALE, "cpu", False, False),  # compiled, never loaded: no crash seen
    (STALE, "gpu", True, False),  # measured on the CPU only
    (GOOD + ["paft.loss.p=0.3", "paft.loss.aggregate=renormalized"], "cpu", True, False),
    (GOOD + ["paft.loss.aggregate=stale"], "cpu", True, False),  # no packet lost: no stale path
])
def test_only_a_stale_cpu_run_with_the_cache_on_is_warned(overrides, backend, cache_on, warned):
    """If this fails, a run whose step crashed XLA:CPU when loaded from the persistent cache
    goes unwarned, or runs that never crashed are warned."""
    text = cache_warning(C.from_dict({}, overrides), backend, cache_on)
    assert (text is not None) == warned
    if warned:
        assert "JAX_COMPILATION_CACHE_DIR" in text and "crashed" in text


def test_the_paft_mode_prints_the_warning_when_it_builds(monkeypatch, capsys):
    # The test session turns JAX's persistent cache on (tests/conftest.py), on the CPU.
    import jax

    from sdcstudy.modes import paft as PM

    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    monkeypatch.setattr(PM.PaftTrainer, "from_config", classmethod(lambda cls, cfg: None))
    PM.PaftMode(C.from_dict({}, STALE))
    assert capsys.readouterr().err.startswith("sdcstudy: warning: JAX's persistent compilation")
    PM.PaftMode(C.from_dict({}, GOOD))
    assert capsys.readouterr().err == ""
