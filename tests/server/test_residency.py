"""The load-on-demand policy as a pure object (appliance/server/residency.py): who is unloaded to make room under
the memory budget (idle ones, least recently used first; never a busy one), when a load must wait, which idle models
outlived their keep_alive; Ollama's keep_alive spellings (appliance/keep_alive.py); the memory estimate and the
--models-memory-budget parser."""

from __future__ import annotations

import math

import pytest

from appliance.config import EngineConfig
from appliance.keep_alive import FOREVER, parse_keep_alive
from appliance.options import ConfigError, parse_memory_budget
from appliance.server.residency import Plan, Residency, Resident, estimate

MB = 1 << 20


def resident(name: str, size: int = 100 * MB, last_used: float = 0.0, busy: bool = False, keep: float = FOREVER):
    return Resident(name, size, last_used, busy, keep)


def test_no_budget_never_unloads():
    assert Residency(None).plan("c", 10**12, [resident("a"), resident("b")]) == Plan()


def test_fits_without_unloading():
    assert Residency(300 * MB).plan("c", 100 * MB, [resident("a"), resident("b")]) == Plan()


def test_least_recently_used_idle_goes_first_and_only_as_many_as_needed():
    policy = Residency(250 * MB)
    residents = [resident("a", last_used=5.0), resident("b", last_used=1.0), resident("c", last_used=3.0)]
    assert policy.plan("d", 100 * MB, residents) == Plan(("b", "c"))
    assert Residency(300 * MB).plan("d", 100 * MB, residents) == Plan(("b",))


def test_a_busy_model_is_never_unloaded_and_the_load_waits():
    policy = Residency(200 * MB)
    residents = [resident("a", last_used=0.0, busy=True), resident("b", last_used=9.0)]
    assert policy.plan("c", 100 * MB, residents) == Plan(("b",))  # the idle one, though more recently used
    assert policy.plan("c", 150 * MB, residents) == Plan(wait=True)  # only the busy one's room would do: wait
    assert policy.plan("c", 150 * MB, [resident("a", busy=True)]) == Plan(wait=True)


def test_the_model_itself_is_not_counted_and_a_larger_than_budget_model_loads_alone():
    policy = Residency(100 * MB)
    assert policy.plan("a", 100 * MB, [resident("a")]) == Plan()
    assert policy.plan("c", 500 * MB, [resident("a"), resident("b", last_used=-1)]) == Plan(("b", "a"), alone=True)
    assert policy.plan("c", 500 * MB, []) == Plan(alone=True)
    assert policy.plan("c", 500 * MB, [resident("a", busy=True)]) == Plan(wait=True, alone=True)


def test_expired_keep_alive():
    residents = [
        resident("forever", last_used=0.0),
        resident("zero", last_used=10.0, keep=0.0),
        resident("short", last_used=5.0, keep=3.0),
        resident("long", last_used=5.0, keep=300.0),
        resident("busy", last_used=0.0, busy=True, keep=0.0),
    ]
    assert Residency.expired(residents, now=10.0) == ["short", "zero"]  # oldest first; busy and forever stay
    assert Residency.expired(residents, now=7.0) == []  # zero's last use is later than now: not yet idle


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("30s", 30.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("300ms", 0.3),
        ("0", 0.0),
        (0, 0.0),
        (90, 90.0),
        (2.5, 2.5),
        ("120", 120.0),
        (-1, FOREVER),
        ("-1", FOREVER),
        ("-5m", FOREVER),
    ],
)
def test_keep_alive_spellings(value, seconds):
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["5 minutes", "m", "", "1x", True, None, [], math.nan, "5m3", "nan", "-nan"])
def test_keep_alive_refused(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


@pytest.mark.parametrize("value", [1e300, "1e300", 10**400, -(10**400), "9999999999999h", math.inf, "inf", 4e9])
def test_keep_alive_past_a_century_is_forever(value):
    """Every finite keep_alive is a date when added to now (/api/ps shows it): longer ones are forever."""
    assert parse_keep_alive(value) == FOREVER


def test_keep_alive_below_a_century_stays_a_duration():
    assert parse_keep_alive(3e9) == 3e9 and parse_keep_alive("800000h") == 800000 * 3600.0


def test_memory_budget_parser():
    assert parse_memory_budget("none") is None
    assert parse_memory_budget("8GiB") == 8 << 30
    assert parse_memory_budget("512MB") == 512 << 20
    assert parse_memory_budget("1000") == 1000
    auto = parse_memory_budget("auto")
    assert auto is None or auto > 0
    for bad in ("lots", "0", "-1GB"):
        with pytest.raises(ConfigError):
            parse_memory_budget(bad)


def test_estimate_is_files_plus_kv(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x" * 1000)
    assert estimate(tmp_path, EngineConfig(kv_cache_bytes=500)) == 1500
    assert estimate(tmp_path, EngineConfig(), kv_bytes=24) == 1024  # measured after a load: wins
    assert estimate(tmp_path, EngineConfig(kv_cache_tokens=10)) == 1000  # no manifest: the files alone


def test_a_model_with_a_job_in_flight_is_never_detached():
    """Models.unload (slots.py) checks the in-flight count under the lock in_flight counts under."""
    from types import SimpleNamespace

    from appliance.server.slots import Models
    from appliance.settings import ModelSpec

    models = Models([ModelSpec("a", "/nowhere", keep_alive="0")], graceful_timeout=1)
    engine = SimpleNamespace(tokenizer="tok")
    models.attach(engine, "CPU", "a")
    slot = models.slot("a")
    assert slot.keep_alive == 0 and not slot.unloaded
    assert models.idle.is_set()  # attached: the reaper looks again (its keep_alive counts from now)
    models.idle.clear()  # what the reaper does before it looks
    with models.in_flight("a", keep_alive=FOREVER):
        assert models.unload("a") is None and slot.engine is engine
        assert models.residents()[0].busy and slot.keep_alive == FOREVER  # the request's keep_alive applies
    assert not models.residents()[0].busy
    assert not models.idle.is_set()  # kept forever now: nothing for the reaper to do, so it is not woken
    with models.in_flight("a", keep_alive=0):
        pass
    assert models.idle.is_set() and slot.keep_alive == 0  # a keep_alive that runs out: the reaper is woken
    assert models.unload("a") is engine and slot.unloaded and slot.tokenizer == "tok"  # kept for /tokenize
    assert models.residents() == [] and models.infos()[0].state == "ready" and not models.infos()[0].loaded
    assert models.unload("a") is None


def test_the_supervisor_waits_for_a_busy_model_then_refuses_and_unloads_it_once_idle():
    """Supervisor._make_room with the policy: a busy model holds the budget (503 after --models-load-wait), an
    idle one is unloaded (its engine shut down) to make room."""
    import time
    from types import SimpleNamespace

    from appliance.protocol import EngineStatus
    from appliance.server.supervisor import Supervisor
    from appliance.settings import ModelSpec, ServeSettings

    specs = [ModelSpec("a", "/nowhere-a"), ModelSpec("b", "/nowhere-b")]
    sup = Supervisor(
        ServeSettings("/nowhere-a", "a", 0, models=specs, models_memory_budget="100", models_load_wait=0.3),
        EngineConfig(),
    )
    registry = sup.service.registry
    down: list[str] = []
    engine = SimpleNamespace(tokenizer=None, on_death=None, shutdown=lambda: down.append("a"))
    registry.attach(engine, "CPU", "a")
    registry.slot("a").size = registry.slot("b").size = 80
    registry.slot("a").facts = EngineStatus("ready")  # what a real engine's status would have been
    with registry.in_flight("a"):
        began = time.monotonic()
        failed = sup._make_room(specs[1], time.monotonic() + 0.3)
        assert failed is not None and failed.status == 503 and failed.code == "models_memory_busy"
        assert "`a`" not in failed.message and "(a)" in failed.message and time.monotonic() - began >= 0.3
        assert down == [] and registry.slot("a").engine is engine
    assert sup._make_room(specs[1], time.monotonic() + 0.3) is None
    assert down == ["a"] and registry.slot("a").unloaded
    assert sup.service.metrics.model_unloads.labels("budget")._value.get() == 1


def test_next_expiry():
    residents = [
        resident("forever", last_used=0.0),
        resident("short", last_used=5.0, keep=3.0),
        resident("long", last_used=5.0, keep=300.0),
        resident("busy", last_used=0.0, busy=True, keep=0.0),
    ]
    assert Residency.next_expiry(residents, now=6.0) == 2.0  # short's, the first to run out
    assert Residency.next_expiry(residents, now=9.0) == 0.0  # already out: at once
    assert Residency.next_expiry([resident("forever"), resident("busy", busy=True, keep=1.0)], now=1.0) is None


def test_the_reaper_sleeps_until_a_keep_alive_runs_out_not_on_a_timer():
    """The keep_alive reaper's waits: without a finite keep_alive it sleeps until woken (no periodic wakeup beside
    the engine's threads); with one, until it runs out; a model's attach and a last job's end wake it."""
    import time
    from types import SimpleNamespace

    from appliance.server.supervisor import Supervisor
    from appliance.settings import ModelSpec, ServeSettings

    specs = [ModelSpec("a", "/nowhere-a"), ModelSpec("b", "/nowhere-b", keep_alive="5s")]
    sup = Supervisor(ServeSettings("/nowhere-a", "a", 0, models=specs), EngineConfig())
    registry = sup.service.registry
    real_idle, waits = registry.idle, []

    class Recorded:  # the reaper's Event: records each wait's timeout; the third wait stops the reaper
        def wait(self, timeout=None):
            waits.append((timeout, real_idle.is_set()))
            if len(waits) == 3:
                sup.stopping.set()
            return True

        def clear(self):
            real_idle.clear()

        def set(self):
            real_idle.set()

        def is_set(self):
            return real_idle.is_set()

    registry.idle = Recorded()
    registry.attach(SimpleNamespace(tokenizer=None), "CPU", "a")  # keep_alive forever
    sup._reaper()
    assert waits[0] == (None, False)  # nothing can expire: asleep until woken, not every half second
    sup.stopping.clear()
    waits.clear()
    registry.attach(SimpleNamespace(tokenizer=None), "CPU", "b")  # 5 s from now
    began = time.monotonic()
    sup._reaper()
    assert waits[0][0] is not None and 5.0 - (time.monotonic() - began) <= waits[0][0] <= 5.0
    real_idle.clear()
    with registry.in_flight("b"):
        assert not real_idle.is_set()
    assert real_idle.is_set()  # the last job's end wakes the reaper to count the new idle time
