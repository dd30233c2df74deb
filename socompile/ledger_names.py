"""The names both sides of a ledger use: the plan predicts them (plan/memory.py, plan/transfers.py) and the
runtime books them (runtime/memory.py HostLedger, runtime/traffic.py TrafficLedger). A leaf module, so the plan
never imports the runtime."""

# Purposes of the host buffers the runtime allocates (opt.host_memory()).
MASTER = "fp32 master"
MOMENTS = "Adam moments"
SPARES = "ping-pong spares"
LANDING = "gradient landing"
ACCUMULATION = "gradient accumulation stage"
STAGING = "bf16 staging copy"
ACTIVATIONS = "offloaded activations"
HOST_PURPOSES = (MASTER, MOMENTS, SPARES, LANDING, ACCUMULATION, STAGING, ACTIVATIONS)

# Purposes of the bytes that cross the host-device link (opt.traffic()).
GRADIENTS = "gradients"
WEIGHT_UPLOAD = "weight upload"
FLOW_FETCH = "flow fetch"
ACTIVATION_OFFLOAD = "activation offload"
ACTIVATION_FETCH = "activation fetch"
