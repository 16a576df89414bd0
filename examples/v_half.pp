# V-Half: half of 1F1B's activation memory.
# Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024),
# the V-Half building block: V-shape placement, F of chunk 0 every 2 slots so
# the lifespans shrink to half of V-ZB's; W in the free slots. Warm-up and
# cool-down are the block form's (docs/language.md): the repetition compacted
# (each pass as early as its inputs and the block's peak allow), then early
# forwards in the warm-up and B before W in the cool-down. At unit costs that is
# the authors' V-Half bubble (their scheduler, zbv_greedy.py) at every d and m.
# Works for every d >= 2 and m >= d (fewer microbatches: valid, but the bubble differs).
schedule v_half {
    param d = 4
    param m = 2 * d
    require d >= 2 and m >= d, "V-Half's block and its measured bubble hold for d >= 2 and m >= d"
    let g = d % 2 == 0 ? 3 : 0        # shifts the backward so no slots collide mod 6
    # bubble per device at unit costs, measured for d >= 2 and m >= d
    let idle = d == 2 ? (m == 2 ? 1 : 0) : 6 * ((d + 1) // 2) - 7
    place vshape
    backward split
    memory M_W = M_B                  # the paper counts activations held until W ends
    block period 6 {
        chunk 0: F at 2*i, B at 6*d + g - 2 - i
        chunk 1: F at 3*d - 2 - i, B at 3*d + g - 1 + 2*i
        W fill
    }
    # the paper: peak (p+2)//2 in units of a 1F1B stage; a V-shape chunk holds half of one
    expect peak_memory <= (d + 2) // 2 * 2 * M_B
    # measured at unit costs (the paper gives no closed form): 6*((d+1)//2) - 7 of
    # bubble per device, the authors' V-Half (0.0649 at d=4, m=12; 0.1056 at d=8,
    # m=24); the plain repetition leaves (7d - 7 + g)/2, 1F1B 6(d - 1) on the same model
    expect bubble == idle / (6*m + idle)
    expect bubble <= 6 * (d - 1) / (6*m + 6 * (d - 1))
}
