# expect: tests/errors/dualpipe_wrong_lane.pp:9:49: error: device 0 runs F1:s0: under 'dualpipe' lane 1 (stages 2..3) takes microbatch 1, and stage 0 is in lane 0 (microbatch 0); use a stage of lane 1 or a microbatch of lane 0
schedule s {
    param d = 2
    param m = 2
    place dualpipe
    order {
        # chunk 0 of a device is its down stage (microbatch 0), chunk 1 its up stage
        if i == 0 {
            F(0, 0); F(1, 1); B(1, 1); W(1, 1); F(1, 0); B(0, 0); W(0, 0)
        } else {
            F(1, 1); F(0, 0); B(0, 0); W(0, 0); B(1, 1); W(1, 1)
        }
    }
}
