# Step 3: delay W to fill the cool-down: W of stage s at 3d + s.
schedule step3 {
    param d = 4
    param m = 2 * d
    place parallel
    backward split
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d + s
    }
    expect peak_memory <= d * M_B
}
