# expect: tests/errors/unknown_order_statement.pp:7:9: error: unknown statement 'fr'; did you mean 'for'?
schedule s {
    param d = 4
    param m = 8
    backward fused
    order {
        fr j in 0..m { F(j) }
    }
}
