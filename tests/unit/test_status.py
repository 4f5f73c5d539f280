"""`blockflow status` rows from two snapshots: block series joined with Triton's on `model` and `gpu_uuid`."""

from __future__ import annotations

from blockflow.control.status import Snapshot, block_rows, task_rows


def _snapshot(at: float, samples: int) -> Snapshot:
    uuid = "GPU-1df59fe6-481e-cca4-b58c-cd0bdfaa8606"
    return Snapshot(
        at=at, ready={"on_gpu": True, "on_cpu": True}, ensembles=set(), instances={"on_gpu": 1, "on_cpu": 1},
        stats={"on_gpu": {"queue": {"count": samples, "ns": samples * 1000}}, "on_cpu": {}},
        samples={
            "blockflow_block_monitor_samples_total": [({"model": "on_gpu", "model_instance": "on_gpu_0", "gpu_uuid": uuid}, 1.0),
                                                      ({"model": "on_cpu", "model_instance": "on_cpu_0"}, 1.0)],
            "blockflow_block_rss_bytes": [({"model": "on_gpu", "model_instance": "on_gpu_0", "gpu_uuid": uuid}, 2.0 * 2**20)],
            # Another GPU's utilisation must not be joined in.
            "nv_gpu_utilization": [({"gpu_uuid": uuid}, 0.25), ({"gpu_uuid": "GPU-00000000-0000"}, 0.9)],
        })


def test_block_rows_join_the_gpu_by_uuid_and_name_cpu_blocks() -> None:
    rows = {r["block"]: r for r in block_rows(_snapshot(0.0, 0), _snapshot(2.0, 10))}
    assert rows["on_gpu"]["device"] == "GPU-1df59fe6" and rows["on_gpu"]["gpu_util"] == 0.25
    assert rows["on_gpu"]["rss_mib"] == 2.0 and rows["on_gpu"]["rate"] == 5.0 and rows["on_gpu"]["queue_ms"] == 0.001
    assert rows["on_cpu"]["device"] == "cpu" and rows["on_cpu"]["gpu_util"] is None and rows["on_cpu"]["rss_mib"] is None


def test_a_links_rate_is_the_samples_handed_to_it() -> None:
    def snap(at: float, samples: float, batches: float) -> Snapshot:
        per = [({"model": "link", "model_instance": f"link_{i}"}, v / 2) for i, v in ((0, samples), (1, samples))]
        return Snapshot(at=at, ready={"link": True}, ensembles=set(), instances={"link": 2}, stats={"link": {}},
                        samples={"blockflow_tmq_link_samples_total": per,
                                 "blockflow_tmq_link_batches_total": [({"model": "link", "model_instance": "link_0"}, batches)]})

    row = block_rows(snap(0.0, 10, 1), snap(2.0, 110, 5))[0]
    assert row["link"] and row["rate"] == 50.0 and row["link_batch"] == 25.0
    plain = block_rows(_snapshot(0.0, 0), _snapshot(2.0, 10))[0]
    assert not plain["link"] and plain["link_batch"] is None


def test_a_tasks_mean_latency_comes_from_tritons_statistics_and_its_quantiles_only_from_summaries() -> None:
    def snap(at: float, n: int, ms: float, summaries: bool) -> Snapshot:
        q = [({"model": "t", "quantile": "0.5"}, 1800.0), ({"model": "t", "quantile": "0.99"}, 2500.0)]
        return Snapshot(at=at, ready={"t": True}, ensembles={"t"}, instances={}, stats={"t": {"success": {"count": n, "ns": int(n * ms * 1e6)}}},
                        samples={"nv_inference_request_summary_us": q} if summaries else {})

    row = task_rows(snap(0.0, 10, 1.0, False), snap(2.0, 30, 2.0, False))[0]
    assert row["rate"] == 10.0 and abs(row["mean_ms"] - 2.5) < 1e-9 and row["p50_ms"] is None and row["p99_ms"] is None
    idle = task_rows(snap(0.0, 10, 1.0, True), snap(2.0, 10, 1.0, True))[0]
    assert idle["mean_ms"] is None and idle["p50_ms"] == 1.8 and idle["p99_ms"] == 2.5
