"""`dspark-run calibrate`: collect the drafter's confidences and the real acceptances of full-length
verification rounds with the engine itself, fit STS temperatures, write calibration.json."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable

import numpy as np

from dspark_calibration.plots import reliability_png
from dspark_calibration.sts import calibration_report, fit_sts
from dspark_runtime.bench import prompt_of
from dspark_runtime.engine import Engine
from dspark_runtime.engine_dir import CALIBRATION
from dspark_runtime.errors import DSparkError
from dspark_runtime.sampling import SamplingParams


def calibrate(engine: Engine, rows: list[dict], params: SamplingParams, plot: bool = True,
              progress: Callable[[], None] | None = None) -> dict:
    """Run every prompt verifying all γ drafts, fit the temperatures on the rounds of even-numbered prompts,
    report the metrics on the rounds of the odd-numbered ones (held out), save and apply the temperatures."""
    block = engine.core.block
    if not block or engine.manifest.drafter.get("confidence") is not True:
        raise DSparkError("calibration needs an engine whose drafter has a confidence head (a DSpark drafter)")
    engine.core.round_log = []
    held_out: list[bool] = []
    try:
        for index, row in enumerate(rows):
            seeded = replace(params, seed=index if params.seed is None else params.seed + index)
            engine.generate(prompt_of(row), seeded, spec=f"fixed:{block}", truncate=True)
            held_out += [index % 2 == 1] * (len(engine.core.round_log) - len(held_out))
            if progress:
                progress()
        log = engine.core.round_log
    finally:
        engine.core.round_log = None
    test = np.array(held_out)
    if min(test.sum(), (~test).sum()) < 50:
        raise DSparkError(f"only {len(log)} full verification rounds were collected; give more prompts or tokens")
    all_logits = np.stack([entry[0] for entry in log])
    all_accepted = np.array([entry[1] for entry in log])
    temperatures = fit_sts(all_logits[~test], all_accepted[~test])
    logits, accepted = all_logits[test], all_accepted[test]
    report = {"rounds_fit": int((~test).sum()), "rounds_held_out": int(test.sum()), "temperature": params.temperature}
    report |= calibration_report(logits, accepted, temperatures)
    (engine.folder / CALIBRATION).write_text(json.dumps(report, indent=1) + "\n")
    if plot:
        report["plot"] = str(engine.folder / "calibration.png") if reliability_png(
            logits, accepted, temperatures, engine.folder / "calibration.png") else None
    engine.core.sts = temperatures
    return report
