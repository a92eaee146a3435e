"""Fleet projection (`baton bench scale`): a discrete-event simulation (simpy) of Baton's own router,
placement and admission code over simulated engines (baton/engine/simulated's scheduler, timed by
AIConfigurator or by a step-time model fitted on CPU engines).

One file each: workloads.py (conversation shapes, arrivals), engine.py (one engine in simulated
time), fleet.py (pools, directory, clients), slo.py (goodput, TTFET), energy.py (GPU power),
calibrate.py (CPU step-time model, the comparison with `bench conserve`), cpu_steps.py (timing a
real vLLM CPU engine for calibrate.py).
"""
