"""`dspark-run calibrate`: collect the drafter's confidences and the real acceptances of full-length
verification rounds with the engine itself, fit STS temperatures, write calibration.json."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable

import numpy as np

from dspark_calibration.plots import reliability_png
from dspark_calibration.sts import DEFAULT_BIASES, calibration_report, fit_sts
from dspark_runtime.bench import prompt_of
from dspark_runtime.engine import Engine
from dspark_common.engine_dir import CALIBRATION, read_calibration
from dspark_common.errors import DSparkError
from dspark_common.sampling import SamplingParams


def calibrate(engine: Engine, rows: list[dict], params: SamplingParams, plot: bool = True,
              progress: Callable[[], None] | None = None, bias: bool = False) -> dict:
    """Run every prompt verifying all γ drafts, fit the temperatures on the rounds of even-numbered prompts,
    report the metrics on the rounds of the odd-numbered ones (held out), save and apply the temperatures.

    Acceptance depends on the sampling temperature (greedy accepts more), so calibration.json keeps one fit
    per sampling temperature and requests use the fit nearest their own. `bias` also fits an offset per
    position (see `dspark_calibration.sts`).
    """
    gamma = engine.gamma
    if not gamma or engine.manifest.drafter.get("confidence") is not True:
        raise DSparkError("calibration needs an engine whose drafter has a confidence head (a DSpark drafter)")
    with engine.record_rounds() as log:  # all prompts at once: the engine batches them over its cache slots
        requests = [
            engine.submit(
                prompt_of(row),
                replace(params, seed=index if params.seed is None else params.seed + index),
                spec=f"fixed:{gamma}",
                truncate=True,
                stream=False,
            )
            for index, row in enumerate(rows)
        ]
        held_out_ids = {request.id for request in requests[1::2]}
        for request in requests:
            request.result()
            if progress:
                progress()
    test = np.array([request_id in held_out_ids for request_id, _, _ in log], dtype=bool)
    if min(test.sum(), (~test).sum()) < 50:
        raise DSparkError(f"only {len(log)} full verification rounds were collected; give more prompts or tokens")
    all_logits = np.stack([logits for _, logits, _ in log])
    all_accepted = np.array([accepted for _, _, accepted in log])
    temperatures, biases = fit_sts(all_logits[~test], all_accepted[~test], biases=DEFAULT_BIASES if bias else None)
    logits, accepted = all_logits[test], all_accepted[test]
    report = {"rounds_fit": int((~test).sum()), "rounds_held_out": int(test.sum()), "temperature": params.temperature}
    report |= calibration_report(logits, accepted, temperatures, biases)
    by_temperature = read_calibration(engine.folder, gamma) | {params.temperature: report}
    file = {"by_temperature": {str(t): entry for t, entry in sorted(by_temperature.items())}}
    (engine.folder / CALIBRATION).write_text(json.dumps(file, indent=1) + "\n")
    if plot:
        report["plot"] = str(engine.folder / "calibration.png") if reliability_png(
            logits, accepted, temperatures, biases, engine.folder / "calibration.png") else None
    engine.set_calibration(by_temperature)
    return report
