# Step 2: split the backward into B (input gradient) and W (weight gradient),
# W right after its B: still 1F1B, but now W can move.
schedule step2 {
    param d = 4
    param m = 2 * d
    place parallel
    backward split
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 - 2*s
    }
    expect peak_memory <= d * M_B
}
