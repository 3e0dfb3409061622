"""Live export and alerts, end to end over real sockets: the OTLP sink
against an in-process OTLP/HTTP receiver (the collector's protobuf wire
format, decoded with opentelemetry-proto), the Webhook sink against a local
HTTP server; bounded series on a 2,000-metric model; a dead endpoint never
reaches the training loop."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
from hookcap import Monitor
from hookcap.sinks import OTLP, Webhook

pytest.importorskip("opentelemetry.sdk.metrics")
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2  # noqa: E402


class Receiver:
    """A local HTTP server keeping what is posted to it: OTLP metrics
    decoded into {(metric, attributes): value}, or JSON bodies."""

    def __init__(self, status=200):
        self.series, self.bodies, self.status = {}, [], status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest()
                    req.ParseFromString(body)
                    for rm in req.resource_metrics:
                        for sm in rm.scope_metrics:
                            for m in sm.metrics:
                                for p in m.gauge.data_points:
                                    attrs = tuple(sorted((a.key, str(getattr(a.value, a.value.WhichOneof("value"))))
                                                         for a in p.attributes))
                                    v = p.as_double if p.HasField("as_double") else p.as_int
                                    outer.series[(m.name, attrs)] = v
                    reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                    ctype = "application/x-protobuf"
                else:
                    outer.bodies.append(json.loads(body))
                    reply, ctype = b"{}", "application/json"
                self.send_response(outer.status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def dead_url():
    r = Receiver()
    url = r.url
    r.close()  # nothing listens there now
    return url


def deep_model(blocks=10, width=100):
    """blocks x width Linear layers: 2,000 output + grad_output metrics."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(*[nn.Linear(4, 4) for _ in range(width)]) for _ in range(blocks)])


def test_otlp_series_stay_within_the_bound_on_a_2000_metric_model(receiver):
    model = deep_model()
    sink = OTLP(receiver.url + "/v1/metrics", interval_s=3600, top=5)
    mon = Monitor(model, capture=("output", "grad_output"), sinks=[sink]).attach()
    with torch.no_grad():
        model[3][7].weight.mul_(1000)  # a planted offender
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
        mon.step()
    h = mon.history()
    assert len(h.names) == 2000
    assert sink.flush()
    mon.detach()
    series = receiver.series
    assert 0 < len(series) <= sink.series_bound() < 2000
    groups = {dict(a)["group"] for (n, a) in series if n == "hookcap.rms"}
    assert groups == {str(i) for i in range(10)}  # one group per block: the deepest cut within 64
    # The groups' values equal the metrics' own, aggregated (rms over elements, absmax the largest).
    last = h.steps[-1]
    for g in ("0", "3"):
        cols = [h.column(n) for n in h.names if n.startswith(f"{g}.") and n.endswith("/output")]
        rms = h["rms"][-1, cols]
        cnt = h["count"][-1, cols]
        want = float(np.sqrt((cnt * rms ** 2).sum() / cnt.sum()))
        got = series[("hookcap.rms", (("group", g), ("kind", "output")))]
        assert got == pytest.approx(want, rel=1e-9)
        assert series[("hookcap.absmax", (("group", g), ("kind", "output")))] == h["absmax"][-1, cols].max()
    top0 = [dict(a)["metric"] for (n, a) in series if n == "hookcap.top.absmax" and dict(a)["rank"] == "0"]
    assert top0 == [h.names[int(np.argmax(h["absmax"][-1]))]] and top0[0].startswith("3.")
    assert series[("hookcap.step", ())] == last
    assert series[("hookcap.otlp.failed_exports", ())] == 0


def test_a_dead_collector_never_reaches_training():
    model = deep_model(2, 5)
    sink = OTLP(dead_url() + "/v1/metrics", interval_s=0.05, timeout_s=0.2)
    mon = Monitor(model, capture=("output",), sinks=[sink]).attach()
    t0 = time.perf_counter()
    for _ in range(5):
        model(torch.randn(8, 4)).sum().backward()
        mon.step()
    took = time.perf_counter() - t0
    assert not sink.flush(1.0)
    mon.detach()
    assert sink.failed_exports >= 1 and not mon.failed_sinks
    assert took < 5.0  # the training loop did not wait for the collector's timeouts


def _spiky_run(sinks, dump=None, steps=90):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    detectors = [hookcap.NonFinite(), hookcap.Threshold("absmax", above=50.0, metrics="0/output")]
    mon = Monitor(model, capture=("output",), sinks=sinks, detectors=detectors, on_anomaly=None,
                  dump_on_anomaly=dump, optimizer=opt).attach()
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        x = torch.randn(16, 4, generator=g)
        if i in (80, 81, 85):  # two runs of a large input: two "threshold" anomalies
            x = x * 100
        if i == 88:  # then a NaN: a "nonfinite" one
            x[0, 0] = float("nan")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    return mon


def test_webhook_posts_once_per_kind_with_first_movers_and_the_dump(receiver, tmp_path):
    hook = Webhook(receiver.url + "/alert", backoff_s=3600)
    mon = _spiky_run([hook], dump=f"{tmp_path}/dumps/")
    hook.close()
    assert [(a.kind, a.step) for a in mon.anomalies] == [("threshold", 80), ("threshold", 85), ("nonfinite", 88)]
    assert hook.sent == 2 and hook.suppressed == 1 and hook.failed == hook.dropped == 0  # step 85: backing off
    spike, nan = sorted(receiver.bodies, key=lambda b: b["step"])
    assert (spike["step"], spike["metric"], spike["kind"]) == (80, "0/output", "threshold")
    assert (nan["step"], nan["kind"]) == (88, "nonfinite")
    assert spike["dump"].endswith("hookcap-anomaly-step80.npz") and nan["dump"].endswith("step88-nonfinite.npz")
    assert hookcap.load(spike["dump"]).steps[-1] == 80
    assert spike["first_movers"][0]["name"] == "0/output" and spike["first_movers"][0]["lead"] == 0
    assert "first moved: 0/output" in spike["text"]


def test_webhook_back_off_lets_a_later_alert_through(receiver):
    hook = Webhook(receiver.url + "/alert", backoff_s=0.0, movers=0)
    _spiky_run([hook])
    hook.close()
    assert hook.sent == len(receiver.bodies) >= 2  # back-off 0: each anomaly posted
    assert all(b["first_movers"] == [] for b in receiver.bodies)


def test_a_failing_webhook_is_counted_not_raised():
    bad = Receiver(status=500)
    hook = Webhook(bad.url + "/alert", backoff_s=0.0, timeout_s=1.0)
    mon = _spiky_run([hook])
    hook.close()
    bad.close()
    dead = Webhook(dead_url() + "/alert", backoff_s=0.0, timeout_s=0.5, queue_size=1)
    _spiky_run([dead])
    dead.close()
    assert hook.failed >= 1 and hook.sent == 0 and not mon.failed_sinks
    assert dead.failed + dead.dropped >= 1 and dead.sent == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        Webhook("ftp://x")
    with pytest.raises(ValueError):
        Webhook("http://x", backoff_s=-1)
    with pytest.raises(ValueError):
        OTLP(top=-1)
    with pytest.raises(ValueError):
        OTLP(depth=0)
    with pytest.raises(ValueError):
        OTLP(stats=("bogus",))
