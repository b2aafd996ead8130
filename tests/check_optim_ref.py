"""Checks the f64 reference updates of tests/test_optim.c against PyTorch.

Not part of the suite (PyTorch is no dependency): run it by hand with a
Python that has torch, e.g. `python tests/check_optim_ref.py`. It ports the
test's reference (ref_sgd, ref_adam, the clipping coefficient) and steps
torch.optim.SGD / Adam / AdamW (foreach=False) and
torch.nn.utils.clip_grad_norm_ in float64 on the same values, printing the
largest difference of each case; they must be at rounding level (< 1e-12).
"""
import math

import torch

SHAPES = [(3, 4), (5, 1)]
STEPS = 6


def init_value(i, j):
    return float(torch.tensor(0.8 * math.cos(0.3 * j + i), dtype=torch.float32))


def grad_value(i, j, step):
    v = 0.5 * math.sin(0.7 * j + 1.3 * step + i) + 0.05 * step
    return float(torch.tensor(v, dtype=torch.float32))


def numel(i):
    return SHAPES[i][0] * SHAPES[i][1]


def ref_sgd(p, buf, o, lr, step):
    for i in range(2):
        for j in range(numel(i)):
            d = grad_value(i, j, step) + o["weight_decay"] * p[i][j]
            if o["momentum"]:
                buf[i][j] = d if step == 0 else o["momentum"] * buf[i][j] + (1 - o["dampening"]) * d
                d = d + o["momentum"] * buf[i][j] if o["nesterov"] else buf[i][j]
            p[i][j] -= lr * d


def ref_adam(p, m, v, o, step):
    b1, b2, lr, wd = o["beta1"], o["beta2"], o["lr"], o["weight_decay"]
    bc1, bc2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
    for i in range(2):
        for j in range(numel(i)):
            g = grad_value(i, j, step)
            if o["decoupled"]:
                p[i][j] *= 1 - lr * wd
            else:
                g += wd * p[i][j]
            m[i][j] = b1 * m[i][j] + (1 - b1) * g
            v[i][j] = b2 * v[i][j] + (1 - b2) * g * g
            p[i][j] -= lr / bc1 * m[i][j] / (math.sqrt(v[i][j]) / math.sqrt(bc2) + o["eps"])


def torch_params():
    return [torch.tensor([init_value(i, j) for j in range(numel(i))], dtype=torch.float64,
                         requires_grad=True) for i in range(2)]


def run(make_opt, ref, o, schedule=None):
    tp = torch_params()
    opt = make_opt(tp)
    p = [[init_value(i, j) for j in range(numel(i))] for i in range(2)]
    s1 = [[0.0] * numel(i) for i in range(2)]
    s2 = [[0.0] * numel(i) for i in range(2)]
    worst = 0.0
    for step in range(STEPS):
        lr = schedule(step) if schedule else o["lr"]
        for g in opt.param_groups:
            g["lr"] = lr
        for i in range(2):
            tp[i].grad = torch.tensor([grad_value(i, j, step) for j in range(numel(i))],
                                      dtype=torch.float64)
        opt.step()
        if ref is ref_sgd:
            ref_sgd(p, s1, o, lr, step)
        else:
            ref_adam(p, s1, s2, dict(o, lr=lr), step)
        for i in range(2):
            worst = max(worst, max(abs(a - b) for a, b in zip(tp[i].tolist(), p[i])))
    return worst


def warmup_cosine(step, warmup, total, base, lo):
    if step < warmup:
        return base * step / warmup
    if step >= total:
        return lo
    return lo + (base - lo) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def main():
    sgd_cases = [
        (dict(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False), None),
        (dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01, nesterov=False), None),
        (dict(lr=0.1, momentum=0.9, dampening=0, weight_decay=0.05, nesterov=True),
         lambda s: warmup_cosine(s, 2, STEPS, 0.1, 0.01)),
        (dict(lr=0.2, momentum=0, dampening=0, weight_decay=0.1, nesterov=False), None),
    ]
    for o, sched in sgd_cases:
        w = run(lambda ps: torch.optim.SGD(ps, lr=o["lr"], momentum=o["momentum"],
                                           dampening=o["dampening"],
                                           weight_decay=o["weight_decay"],
                                           nesterov=o["nesterov"], foreach=False),
                ref_sgd, o, sched)
        print(f"SGD {o}: {w:.3g}")
        assert w < 1e-12
    adam_cases = [
        dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True),
        dict(lr=0.1, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.5, decoupled=True),
        dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=False),
    ]
    for o in adam_cases:
        cls = torch.optim.AdamW if o["decoupled"] else torch.optim.Adam
        w = run(lambda ps: cls(ps, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
                               weight_decay=o["weight_decay"], foreach=False),
                ref_adam, o)
        print(f"{cls.__name__} {o}: {w:.3g}")
        assert w < 1e-12
    # clipping: total norm and coefficient max_norm / (total + 1e-6)
    for norm_type in (2.0, math.inf):
        ps = torch_params()
        for i in range(2):
            ps[i].grad = torch.tensor([grad_value(i, j, 3) for j in range(numel(i))],
                                      dtype=torch.float64)
        g0 = [p.grad.clone() for p in ps]
        flat = [abs(x) for g in g0 for x in g.tolist()]
        want = max(flat) if norm_type == math.inf else math.sqrt(sum(x * x for x in flat))
        total = float(torch.nn.utils.clip_grad_norm_(ps, want / 4, norm_type, foreach=False))
        coef = (want / 4) / (want + 1e-6)
        w = max(abs(total - want),
                max(float((p.grad - g * coef).abs().max()) for p, g in zip(ps, g0)))
        print(f"clip_grad_norm_ norm_type {norm_type}: {w:.3g}")
        assert w < 1e-12
    print("ok")


if __name__ == "__main__":
    main()
