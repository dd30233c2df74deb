"""The performance model: what a step costs on a hardware profile. Formulas per node, transfer and optimizer
step (cost.py), one pass over the IR for per-node times, weight uses and activation peaks (analysis.py), the
tasks of one step (simulate.py) and the event-driven replay they run on (timeline.py). It predicts; the
planner (socompile/plan/) decides."""
