"""A research plugin kernel (benchmarks/bench_stream.py): how fast a CTA can stream weight rows whose K
quarter is larger than its registers hold, beside a bare stream of the same loads."""
