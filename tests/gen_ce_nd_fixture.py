#!/usr/bin/env python3
"""Prints the torch.nn.functional.cross_entropy fixture that
tests/test_ops_loss.c (cross_entropy_nd_matches_pytorch) embeds.

Logits (N, C, d1, d2) = (2, 4, 2, 3) with x[i] = ((7 i) % 19 - 9) / 4 over the
flat index i (exact in f32), targets (2, 2, 3) with one ignored (-100),
class weights [0.5, 1, 2, 1.5]; computed in float64. Also an unbatched case:
logits (4,) = x[0:4], target 2.

Run: python3 tests/gen_ce_nd_fixture.py (needs torch)."""
import torch
import torch.nn.functional as F

N, C, D1, D2 = 2, 4, 2, 3
x = torch.tensor([((7 * i) % 19 - 9) / 4 for i in range(N * C * D1 * D2)],
                 dtype=torch.float64).reshape(N, C, D1, D2)
t = torch.tensor([[[0, 3, 1], [2, -100, 3]], [[1, 1, 0], [3, 2, 0]]])
w = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64)


def arr(name, v):
    vals = [f"{float(a):.17g}" for a in v.detach().flatten()]
    print(f"static const double {name}[{len(vals)}] = {{")
    line = "   "
    for s in vals:
        if len(line) + len(s) + 2 > 99:
            print(line)
            line = "   "
        line += f" {s},"
    print(line)
    print("};")


arr("PT_LOSS_NONE_W", F.cross_entropy(x, t, weight=w, reduction="none"))
arr("PT_LOSS_SUM", F.cross_entropy(x, t, reduction="sum").reshape(1))
arr("PT_LOSS_MEAN_W", F.cross_entropy(x, t, weight=w).reshape(1))
xg = x.clone().requires_grad_()
F.cross_entropy(xg, t, weight=w).backward()
arr("PT_GRAD_MEAN_W", xg.grad)
xg = x.clone().requires_grad_()
F.cross_entropy(xg, t, reduction="sum").backward()
arr("PT_GRAD_SUM", xg.grad)
xu = x.flatten()[:C].clone().requires_grad_()
lu = F.cross_entropy(xu, torch.tensor(2), weight=w)
lu.backward()
arr("PT_LOSS_UNBATCHED_W", lu.reshape(1))
arr("PT_GRAD_UNBATCHED_W", xu.grad)
