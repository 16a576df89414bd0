# expect: tests/errors/comm_not_a_line.pp:5:17: error: a transfer's cost is latency + bytes / bandwidth, a line in 'bytes', and this one is not: at bytes = 2 it is 4, where the line through bytes = 0 and 1 gives 2
schedule s {
    param d = 2
    param m = 2
    cost comm = bytes * bytes
    backward fused
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
