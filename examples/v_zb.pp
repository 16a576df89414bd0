# V-ZB: the V-shape building block with no bubble in its steady state, at 1F1B's memory.
# Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024), V-ZB:
# chunk 0 = stage i, chunk 1 = stage 2d-1-i; one F B W of each chunk per period 6. The
# slots are ZB-V's steady state (zb_v.pp) read off as one block. Repeated, the block
# leaves 2d - 2 of bubble in warm-up and cool-down; the compiler's warm-up/cool-down
# step (early forwards in the warm-up, B before W in the cool-down, never above the
# repetition's activation peak) removes it, as the paper does: no bubble at unit costs
# and exactly 2p chunks per device (p in 1F1B-stage units).
# Works for every d >= 1 and m >= 2d - 1 (required below: with fewer microbatches the
# order is still valid, with a smaller peak and some bubble).
schedule v_zb {
    param d = 4
    param m = 2 * d
    require m >= 2*d - 1, "V-ZB's zero bubble and 2d peak need m >= 2d - 1 microbatches"
    place vshape
    backward split
    memory M_W = M_B                  # the paper counts activations held until W ends
    block period 6 {
        chunk 0: F at 4*i, B at 12*d - 5 - 2*i, W at 12*d - 4 - 2*i
        chunk 1: F at 6*d - 3 - 2*i, B at 6*d - 2 + 4*i, W at 6*d - 1 + 4*i
    }
    # the paper: V-ZB peaks at p in units of a 1F1B stage; a V-shape chunk holds half of one
    expect peak_memory <= 2 * d * M_B
    expect peak_memory[0] == 2 * d * M_B
    # the paper: no bubble when T_F = T_B = T_W (checked at the default unit costs)
    expect bubble == 0
    expect makespan == 6*m + d - 1
}
