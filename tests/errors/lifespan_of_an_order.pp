# expect: tests/errors/lifespan_of_an_order.pp:10:5: error: `expect lifespan` needs a building block (`block period T { ... }`); this schedule is written as an order, whose passes have no lifespan in a period
schedule s {
    param d = 2
    param m = 4
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m { BW(j) }
    }
    expect lifespan <= 8
}
