# Step 4: W one slot earlier, at 3d - 1 + s: ZB-H1, a third of 1F1B's bubble at
# the same memory.
schedule step4 {
    param d = 4
    param m = 2 * d
    place parallel
    backward split
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 + s
    }
    expect peak_memory <= d * M_B
    expect bubble == (d - 1) / (3*m + d - 1)   # the paper's formula at unit costs
}
