"""Host time of a decode step: the smoke checkpoint (a toy model, so the device's part is small)
decoding one step at 1 and 4 rows, 400 calls each: the wall of a waited call (median, p10), the
dispatch alone (wait=False), and the step's argument leaves. Prints a table and one JSON line.

    python -m benchmarks.host_time
"""
from __future__ import annotations

import json
import time

import numpy as np


def main() -> int:
    import mmjax
    from benchmarks.checkpoints import build_llava

    vlm = mmjax.load(str(build_llava("smoke")), max_num_seqs=4, max_model_len=256)
    r = vlm.engine.runner
    out = {"bench": "host_time", "lm_leaves": len(r.lm_leaves)}
    for rows in (1, 4):
        for _ in range(21):
            r.decode(64, rows)
        waited, dispatched = [], []
        for _ in range(400):
            t = time.perf_counter()
            r.decode(64, rows)
            waited.append(time.perf_counter() - t)
        for _ in range(400):
            t = time.perf_counter()
            p = r.decode(64, rows, wait=False)
            dispatched.append(time.perf_counter() - t)
            p.result()
        out[f"rows{rows}"] = {"step_ms_median": float(np.median(waited) * 1e3),
                              "step_ms_p10": float(np.percentile(waited, 10) * 1e3),
                              "dispatch_ms_median": float(np.median(dispatched) * 1e3)}
    print(f"decode step of the smoke checkpoint, {out['lm_leaves']} argument leaves (the decoder's weights)")
    print(f"{'rows':>5}{'step ms (median)':>18}{'step ms (p10)':>15}{'dispatch ms':>13}")
    for rows in (1, 4):
        f = out[f"rows{rows}"]
        print(f"{rows:>5}{f['step_ms_median']:>18.3f}{f['step_ms_p10']:>15.3f}{f['dispatch_ms_median']:>13.3f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
