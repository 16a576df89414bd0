# V-Min: about a third of 1F1B's activation memory.
# Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024),
# the V-Min building block: V-shape placement, chunk 0 = stage i, chunk 1 =
# stage 2d-1-i; every pass as early as its dependencies allow; W in the free slots.
# Works for every d >= 2 and m >= 2 (the peak reaches the bound once m >= d).
schedule v_min {
    param d = 4
    param m = 2 * d
    require d >= 2 and m >= 2, "V-Min's block needs d >= 2 and m >= 2"
    let g = d % 3 == 0 ? 2 : 0        # shifts the backward so no slots collide mod 6
    place vshape
    backward split
    memory M_W = M_B                  # the paper counts activations held until W ends
    block period 6 {
        chunk 0: F at i, B at 4*d + g - 1 - i
        chunk 1: F at 2*d - 1 - i, B at 2*d + g + i
        W fill
    }
    # the paper: peak (p+4)//3 in units of a 1F1B stage; a V-shape chunk holds half of one
    expect peak_memory <= (d + 4) // 3 * 2 * M_B
    # measured at unit costs (the paper gives no closed form): 4d - 5 + g of bubble per
    # device (the warm-up/cool-down step would raise the peak here, so the plain
    # repetition stands), against 1F1B's 6(d - 1) on the same model
    # (equal when d is no multiple of 3; where g = 2 the simulator measures less)
    expect bubble <= (4*d - 5 + g) / (6*m + 4*d - 5 + g)
    expect bubble <= 6 * (d - 1) / (6*m + 6 * (d - 1))
}
