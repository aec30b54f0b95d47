#!/usr/bin/env bash
# The multi-host table of docs/multihost.md: all-reduce across real hosts on this machine
# (bin/cluster-local), links shaped to RATE, against the link bound 2(H-1)/H x S / rate.
#
#   sudo bash benchmarks/multihost.sh [RATE] [OUTDIR] [SIZES] [MTU]
#
# RATE    the links' rate each way (default 1gbit; slow enough that the links, not the cores,
#         limit the run on a small machine)
# OUTDIR  where the tables (Markdown) and samples (JSON) go (default bench-multihost/)
# SIZES   -b/-e of the sweep (default "16M 64M")
# MTU     the links' MTU in bytes (default 1500; 9000 = jumbo frames, which cut the TCP/IP
#         headers' share of the link from about 4.4 % to 0.7 %)
#
# Layouts: 2 hosts x 2 ranks, uneven hosts (3 + 1 ranks), and 4 hosts x 1 rank. Each starts
# with `bin/cluster-local throughput` (what TCP gets through the links), and the cluster is
# removed at the end (also on failure or Ctrl-C).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RATE=${1:-1gbit}
OUT=${2:-bench-multihost}
read -r MIN MAX <<< "${3:-16M 64M}"
MTU=${4:-1500}
export CLUSTER_LOCAL_NAME=msbench CLUSTER_LOCAL_DIR=/tmp/cluster-bench CLUSTER_LOCAL_SUBNET=10.83.0
export PATH="$PWD/.venv/bin:$PATH"
[ -x .venv/bin/mpistrat ] || { echo "run 'bash bin/demo' (or bin/test) first: no .venv" >&2; exit 2; }
mkdir -p "$OUT"
trap 'bash bin/cluster-local down >/dev/null 2>&1 || true' EXIT

sweep() {  # sweep NAME NP ALGORITHMS: one bench run with the cluster's environment
    echo "=== $1: $(bash bin/cluster-local throughput 64 | xargs)" | tee "$OUT/$1.txt"
    (eval "$(bash bin/cluster-local env)"
     mpistrat bench --np "$2" -b "$MIN" -e "$MAX" -f 2 --shards 1 --algorithms "$3" \
         --recommend --markdown "$OUT/$1.md" --json "$OUT/$1.json") | tee -a "$OUT/$1.txt"
}

TWO_LEVEL=native,xring,rechd,pscpu,pscpu/pscpu,pscpu/pscpu#2,shm/rechd,shm/xring,shm/pscpu
bash bin/cluster-local up --hosts 2 --slots 2 --link-rate "$RATE" --mtu "$MTU"
sweep "2x2-$RATE" 4 "$TWO_LEVEL"
printf 'node1:3\nnode2:1\n' > "$CLUSTER_LOCAL_DIR/hostfile"     # uneven: 3 + 1 ranks
sweep "3+1-$RATE" 4 "$TWO_LEVEL"
bash bin/cluster-local down
bash bin/cluster-local up --hosts 4 --slots 1 --link-rate "$RATE" --mtu "$MTU"
sweep "4x1-$RATE" 4 native,xring,rechd,pscpu,pscpu#4
echo "tables in $OUT/"
