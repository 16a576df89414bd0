# Step 1: 1F1B as a building block (F at s, its fused backward at 3d-2-2s, period 3).
schedule step1 {
    param d = 4
    param m = 2 * d
    place parallel
    backward fused
    block period 3 {
        F at s
        BW at 3*d - 2 - 2*s
    }
    expect peak_memory <= d * M_B
}
