"""bfloat16 serving with openpi's float32 islands, measured against float32 on the model oracle cases
(python -m oxygen_ros.tools.precision; figures in the README). The islands' dtypes are checked in
test_checkpoint.py; here the effect on the actions."""
from oxygen_ros.tools.precision import DEFAULT_CASES, measure

# Measured on the CPU (torch 2.13): all-bf16 max 0.037 / 0.025, mean 0.0088 / 0.0061; islands max 0.050 /
# 0.026, mean 0.0076 / 0.0055 (case_a / case_c). Bounds with room for another CPU's bf16 kernels.
MAX_ABS = 0.1
MEAN_ABS = 0.015


def test_bf16_action_deviation_from_float32():
    result = measure(DEFAULT_CASES)
    for case, modes in result.items():
        for mode, r in modes.items():
            assert r["max_abs"] <= MAX_ABS and r["mean_abs"] <= MEAN_ABS, (case, mode, r)
            assert r["mean_abs"] > 0, (case, mode)          # bfloat16 really ran
        # The islands keep the action path's ends in float32: on average closer to float32.
        assert modes["bf16_islands"]["mean_abs"] < modes["bf16_all"]["mean_abs"], (case, modes)
