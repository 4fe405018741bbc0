"""``kvplane serve``'s workers and the router show the seed's six metrics on ``/metrics``, under
the same names; ``--attention measured`` reaches the model and its plan traces (issue 35)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.apps.serve import build_worker
from kvplane.apps.serve_config import settle
from kvplane.attention import Decision
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.metrics import SEED_METRICS, MetricsRegistry
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.producers.model import ModelKV, ModelSpec
from kvplane.serving.router.observe import RouterMetrics
from kvplane.serving.router.router import Router
from kvplane.serving.router.service import RouterService
from kvplane.serving.worker import Worker
from kvplane.testing.cluster import free_port


@dataclass
class Served:
    prefill: Worker
    decode: Worker
    router: Router
    service: RouterService
    ports: dict[str, int]


def _worker(role: str, port: int, *extra: str) -> Worker:
    args = build_parser().parse_args(
        ["serve", role, "--insecure", "--model", "tiny-deepseek", "--num-blocks", "32",
         "--num-slots", "4", "--step-size", "16", "--metrics-port", str(port), *extra]
    )  # fmt: skip
    return build_worker(settle(args, {}))


@pytest.fixture
def served() -> Iterator[Served]:
    ports = {role: free_port() for role in ("prefill", "decode", "router")}
    p = _worker("prefill", ports["prefill"], "--attention", "measured")
    d = _worker("decode", ports["decode"])
    p.start()
    d.start()
    router = Router([p.address], [d.address], timeout_s=20.0)
    service = RouterService(router, "tcp://127.0.0.1:0", metrics_port=ports["router"])
    try:
        router.connect()
        service.start()
        yield Served(p, d, router, service, ports)
    finally:
        service.close()
        router.close()
        p.close()
        d.close()


def scrape(port: int) -> dict[str, dict[str, float]]:
    """``/metrics`` at ``port``: family name -> {sample name with labels: value}."""
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {
        f.name: {s.name + str(sorted(s.labels.items())): s.value for s in f.samples}
        for f in text_string_to_metric_families(text)
    }


def test_every_role_shows_the_six_and_measured_shows_in_the_traces(served: Served) -> None:
    res = served.router.generate("r0", list(range(1, 41)), max_new_tokens=4)
    assert res.state == "success", res.reason
    assert isinstance(served.prefill, PrefillWorker)
    producer = served.prefill.producer
    assert isinstance(producer, ModelKV)
    model = producer.model
    assert model.backend == "measured"
    selected = [
        e for plan in model.last_plans for e in plan.trace if e.decision is Decision.SELECTED
    ]
    assert selected and all(e.reason == "fastest measured" for e in selected)
    assert all(e.seconds is not None for e in selected)
    seen = {role: scrape(port) for role, port in served.ports.items()}
    for role, families in seen.items():
        assert set(SEED_METRICS) <= set(families), role
    pre, dec, rtr = seen["prefill"], seen["decode"], seen["router"]
    plans = pre["kvplane_attention_plans"]
    assert sum(v for k, v in plans.items() if "'mode', 'measured'" in k) > 0
    assert dec["kvplane_attention_plans"]  # the decoder's plans reach its /metrics too
    fb = "kvplane_attention_fallback_ratio"
    assert pre[fb] == dec[fb] == rtr[fb] == {fb + "[]": 0.0}
    # the router's histograms are its workers' summed
    count = "kvplane_pd_overlap_ratio_count[]"
    overlap = "kvplane_pd_overlap_ratio"
    assert rtr[overlap][count] == pre[overlap][count] + dec[overlap][count] == 1.0


def test_the_router_collector_sums_its_workers() -> None:
    reg = MetricsRegistry()
    workers = [
        {"kvplane_pd_exposed_tail_seconds_bucket:0.01": 1,
         "kvplane_pd_exposed_tail_seconds_bucket:+Inf": 2,
         "kvplane_pd_exposed_tail_seconds_count": 2,
         "kvplane_pd_exposed_tail_seconds_sum_nano": 3 * 10**9,
         "attention_plans": 6, "attention_fallbacks": 0},
        {"attention_plans": 4, "attention_fallbacks": 1},
    ]  # fmt: skip
    RouterMetrics(reg, flights=lambda: 0, workers=lambda: (2, 0), cluster=lambda: workers)
    assert reg.value("pd_exposed_tail_seconds", {"le": "0.01"}, "_bucket") == 1.0
    assert reg.value("pd_exposed_tail_seconds", {"le": "+Inf"}, "_bucket") == 2.0
    assert reg.value("pd_exposed_tail_seconds", suffix="_sum") == 3.0
    assert reg.value("pd_release_latency_seconds", {"le": "+Inf"}, "_bucket") == 0.0
    assert reg.value("attention_fallback_ratio") == 0.1
    text = reg.render().decode()
    assert all(f"# TYPE {name} " in text for name in SEED_METRICS)


def test_attention_flag_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"ModelSpec\.attention must be auto or measured"):
        ModelSpec("tiny-llama", attention="fastest")
    assert ModelSpec("tiny-deepseek", attention="torch,mha").attention == "torch,mha"
    args = build_parser().parse_args(["serve", "decode", "--insecure"])
    assert settle(args, {"KVPLANE_MODEL_ATTENTION": "measured"}).attention == "measured"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "decode", "--attention", "fastest"])
