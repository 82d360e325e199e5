#!/usr/bin/env bash
# Several emulated "nodes" on this one machine, joined by a shaped link: for running torchrun / gloo jobs and
# `ppsim calibrate --collectives` across hosts without a cluster.
#
#   scripts/cluster-local.sh start --nodes 2 --link 1gbit [--delay 1ms] [--prefix ppsim]
#   scripts/cluster-local.sh status [--prefix P]   # the nodes, addresses and qdiscs; exit 0 up, 3 not running
#   scripts/cluster-local.sh exec NODE -- CMD...   # CMD inside node NODE's namespace (environment kept)
#   scripts/cluster-local.sh env [--prefix P]      # `export NAME=value` lines: node addresses, MASTER_ADDR (node 0)
#   scripts/cluster-local.sh stop [--prefix P]     # removes every namespace, veth and bridge start made
#
# Design: one network namespace per node (P-node0, P-node1, ...), each with its own loopback up and one interface
# `eth0` (address NET.1, NET.2, ...; NET is PPSIM_CLUSTER_NET, default 10.77.0, a /24 that exists only inside the
# namespaces). Each eth0 is one end of a veth pair whose other end (P-v0, P-v1, ...) is a port of a bridge (P-br) in
# the root namespace; the bridge has no address, so the root namespace and the real network never see this traffic.
# Both ends of every veth are shaped with `tc qdisc ... tbf rate RATE`: a node's eth0 limits what it sends, the
# bridge-side end limits what it receives, so every node has one link of RATE per direction (a star through a
# switch, as in a cluster). `--delay D` adds `netem delay D` under each tbf where the kernel has netem; without it
# start refuses (exit 2) rather than run without the delay asked for. gloo picks its interface from
# GLOO_SOCKET_IFNAME, which `exec` sets to eth0 (unless already set), with PPSIM_NODE_RANK and PPSIM_NODE_ADDR.
#
# Processes: `exec` runs `ip netns exec`, which keeps the caller's environment (a venv's PATH, VIRTUAL_ENV...).
# stop first ends the processes still running inside the nodes' namespaces (SIGTERM, then SIGKILL after 5 s): only
# `exec` put processes there. Names are all derived from --prefix (at most 10 characters: interface names are
# limited to 15), so stop never touches another prefix's namespaces or anything it did not make. A state file
# ${PPSIM_CLUSTER_DIR:-${TMPDIR:-/tmp}}/P-cluster.env keeps the link and delay for `status` and `env`.
#
# Needs root, iproute2 (`ip`), `tc` and a kernel that allows network namespaces, veth, bridges and tbf; whatever is
# missing is one line and exit 2. Bad arguments: one line, exit 2. Every command is idempotent: start on running
# nodes with the same shape and stop on stopped ones only say so.
#
# Slurm: scripts/slurm-local.sh runs one slurmd for this host; one slurmd per namespace was NOT tried (slurm-wlm is
# not installed on the machine this was written on). What it would need: the nodes share this host's UTS namespace,
# so every slurmd takes NodeName from the same host name; each would have to be started as `slurmd -N nodeK`
# (Slurm's multiple-slurmd mode, a build option) with its own SlurmdPort, spool and pid file, slurm.conf would list
# NodeName=nodeK NodeAddr=NET.K+1, and slurmctld, which runs in the root namespace, would need a route to the
# nodes' subnet (the bridge has no address by design: it would get NET.254). Until then the multi-node recipe
# (calibrate/slurm/calibrate-comm.sbatch) is tried by running its torchrun lines on these nodes directly.
set -euo pipefail

PREFIX=ppsim
NODES=
LINK=
DELAY=
NET=${PPSIM_CLUSTER_NET:-10.77.0}
IFNAME=eth0

say() { echo "cluster-local: $*"; }
die() { echo "cluster-local: $1" >&2; exit "${2:-1}"; }
bad() { die "$*" 2; }

usage() {
    cat <<EOF
usage: $0 start --nodes N --link RATE [--delay D] [--prefix P]
       $0 stop|status|env [--prefix P]
       $0 exec NODE [--prefix P] -- CMD...
Emulated nodes on this machine: one network namespace per node, joined through a bridge by veth pairs shaped with
tc tbf to RATE per direction (e.g. 1gbit, 200mbit, 10gbit). NODE is a node number (0..N-1). Needs root, ip and tc.
  start    create P-node0..P-node{N-1} (addresses ${NET}.1, ${NET}.2, ...) and the shaped links
  stop     end processes in the nodes, remove the namespaces, veths and the bridge (only P's)
  status   show the nodes and their qdiscs; exit 3 when not running
  env      print export lines: PPSIM_NODE_ADDRS, MASTER_ADDR (node 0), PPSIM_NODES, PPSIM_LINK, ...
  exec     run CMD in node NODE's namespace, with GLOO_SOCKET_IFNAME=$IFNAME, PPSIM_NODE_RANK, PPSIM_NODE_ADDR
EOF
}

state_file() { echo "${PPSIM_CLUSTER_DIR:-${TMPDIR:-/tmp}}/${PREFIX}-cluster.env"; }
ns() { echo "${PREFIX}-node$1"; }
addr() { echo "${NET}.$(($1 + 1))"; }
bridge() { echo "${PREFIX}-br"; }

check_prefix() {
    [[ $PREFIX =~ ^[A-Za-z][A-Za-z0-9]{0,9}$ ]] \
        || bad "--prefix $PREFIX: letters and digits, starting with a letter, at most 10 (e.g. --prefix ppsim)"
}

check_rights() {
    [[ $(id -u) == 0 ]] || bad "must run as root (network namespaces, veth pairs and tc need CAP_NET_ADMIN)"
    command -v ip >/dev/null || bad "ip not found; install iproute2 (apt-get install -y iproute2)"
    command -v tc >/dev/null || bad "tc not found; install iproute2 (apt-get install -y iproute2)"
}

# names of our namespaces that exist, in node order
our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}-node[0-9]+$" | sort -V || true
}

rate_ok() { [[ ${1,,} =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$ ]]; }
delay_ok() { [[ ${1,,} =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]]; }

# bytes per second of a tc rate ("1gbit" -> 125000000), integer
rate_bytes() {
    local r=${1,,} num unit
    num=$(sed -E 's/^([0-9.]+).*/\1/' <<<"$r")
    unit=$(sed -E 's/^[0-9.]+//' <<<"$r")
    awk -v n="$num" -v u="$unit" 'BEGIN {
        m["bit"]=1/8; m["kbit"]=1e3/8; m["mbit"]=1e6/8; m["gbit"]=1e9/8; m["tbit"]=1e12/8;
        m["bps"]=1; m["kbps"]=1e3; m["mbps"]=1e6; m["gbps"]=1e9; m["tbps"]=1e12;
        printf "%d", n * m[u] }'
}

# shape one interface's egress (run inside namespace $1, or the root namespace when $1 is empty)
shape() {
    local where=$1 dev=$2 burst run=()
    [[ -n $where ]] && run=(ip netns exec "$where")
    # burst: 1 ms of the rate, at least 64 KiB (one TSO segment, so the bucket never starves a full-size packet);
    # a larger bucket would let messages of a few MiB pass at the veth's own speed
    burst=$(( $(rate_bytes "$LINK") / 1000 ))
    ((burst < 65536)) && burst=65536
    "${run[@]}" tc qdisc replace dev "$dev" root handle 1: tbf rate "$LINK" burst "$burst" latency 100ms \
        2>/dev/null || return 1
    if [[ -n $DELAY ]]; then
        "${run[@]}" tc qdisc replace dev "$dev" parent 1:1 handle 10: netem delay "$DELAY" 2>/dev/null || return 2
    fi
}

start() {
    [[ -n $NODES ]] || bad "start needs --nodes N (e.g. --nodes 2)"
    [[ $NODES =~ ^[0-9]+$ ]] && ((10#$NODES >= 1 && 10#$NODES <= 250)) \
        || bad "--nodes $NODES: must be an integer from 1 to 250 (e.g. --nodes 2)"
    NODES=$((10#$NODES))
    [[ -n $LINK ]] || bad "start needs --link RATE (e.g. --link 1gbit)"
    rate_ok "$LINK" || bad "--link $LINK: not a tc rate; e.g. 1gbit, 200mbit, 10gbit, 125mbps"
    (( $(rate_bytes "$LINK") >= 1 )) || bad "--link $LINK: a link of no bandwidth (under 1 byte/s); give a rate above 0, e.g. 1gbit"
    [[ -z $DELAY ]] || delay_ok "$DELAY" || bad "--delay $DELAY: not a time; e.g. 1ms, 200us"
    check_rights

    local existing state
    existing=$(our_namespaces)
    state=$(state_file)
    if [[ -n $existing ]]; then
        if [[ -f $state ]] && grep -qx "PPSIM_NODES=$NODES" "$state" && grep -qx "PPSIM_LINK=$LINK" "$state" \
            && grep -qx "PPSIM_DELAY=$DELAY" "$state" && [[ $(wc -l <<<"$existing") == "$NODES" ]]; then
            say "already running: $NODES nodes at $LINK${DELAY:+, delay $DELAY} (prefix $PREFIX)"
            return 0
        fi
        die "nodes of prefix $PREFIX exist with another shape ($(tr '\n' ' ' <<<"$existing")); run: $0 stop --prefix $PREFIX"
    fi

    # can we make a namespace at all? (a container may refuse)
    local probe="${PREFIX}-probe$$" why
    if ! why=$(ip netns add "$probe" 2>&1); then
        bad "network namespaces refused here (ip netns add: ${why:-failed}); run on a host or a privileged container"
    fi
    ip netns del "$probe" 2>/dev/null || true

    trap 'echo "cluster-local: start failed; removing what it made" >&2; stop >/dev/null 2>&1 || true' ERR
    local br i n
    br=$(bridge)
    say "starting $NODES nodes joined at $LINK per direction${DELAY:+, delay $DELAY} (prefix $PREFIX, net $NET.0/24)"
    ip link add "$br" type bridge 2>/dev/null || { trap - ERR; stop >/dev/null 2>&1 || true;
        bad "could not create the bridge $br (ip link add type bridge refused; does the kernel have bridging?)"; }
    ip link set "$br" up
    for ((i = 0; i < NODES; i++)); do
        n=$(ns "$i")
        ip netns add "$n"
        ip -n "$n" link set lo up
        ip link add "${PREFIX}-v$i" type veth peer name "${PREFIX}-n$i" netns "$n"
        ip -n "$n" link set "${PREFIX}-n$i" name "$IFNAME"
        ip -n "$n" addr add "$(addr "$i")/24" dev "$IFNAME"
        ip -n "$n" link set "$IFNAME" up
        ip link set "${PREFIX}-v$i" master "$br"
        ip link set "${PREFIX}-v$i" up
        local rc=0
        shape "$n" "$IFNAME" || rc=$?
        ((rc == 0)) && { shape "" "${PREFIX}-v$i" || rc=$?; }
        if ((rc != 0)); then
            trap - ERR
            stop >/dev/null 2>&1 || true
            ((rc == 2)) && bad "--delay $DELAY: netem is absent from this kernel (tc qdisc netem refused), so the delay cannot be applied; start without --delay"
            bad "tc tbf refused on $IFNAME (is sch_tbf in the kernel?); nothing was started"
        fi
    done
    trap - ERR
    mkdir -p "$(dirname "$state")"
    {
        echo "PPSIM_CLUSTER_PREFIX=$PREFIX"
        echo "PPSIM_NODES=$NODES"
        echo "PPSIM_LINK=$LINK"
        echo "PPSIM_DELAY=$DELAY"
        echo "PPSIM_CLUSTER_NET=$NET"
    } >"$state"
    # wait until node 0 reaches the last node (the bridge's ports forward once they are up); without ping, trust it
    local last=$((NODES - 1)) up
    up=$(for ((i = 0; i < NODES; i++)); do printf '%s=%s ' "$(ns "$i")" "$(addr "$i")"; done)
    if ((NODES > 1)) && command -v ping >/dev/null; then
        for _ in $(seq 1 50); do
            ip netns exec "$(ns 0)" ping -c 1 -W 1 "$(addr "$last")" >/dev/null 2>&1 && break
            sleep 0.1
        done
    fi
    say "up: $up"
}

stop() {
    check_rights
    local namespaces n pids any=0 i
    namespaces=$(our_namespaces)
    for n in $namespaces; do
        pids=$(ip netns pids "$n" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            say "ending processes in $n: $(tr '\n' ' ' <<<"$pids")"
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
        fi
    done
    for n in $namespaces; do
        for _ in $(seq 1 50); do
            [[ -z $(ip netns pids "$n" 2>/dev/null || true) ]] && break
            sleep 0.1
        done
        pids=$(ip netns pids "$n" 2>/dev/null || true)
        # shellcheck disable=SC2086
        [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
        ip netns del "$n" 2>/dev/null || true
        any=1
    done
    # the veths die with their namespace; remove any left (a start that failed half way) and the bridge
    for i in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
            | grep -E "^${PREFIX}-v[0-9]+$" || true); do
        ip link del "$i" 2>/dev/null || true
        any=1
    done
    if ip link show "$(bridge)" >/dev/null 2>&1; then
        ip link del "$(bridge)" 2>/dev/null || true
        any=1
    fi
    rm -f "$(state_file)"
    if ((any)); then
        say "stopped; removed the namespaces, veths and bridge of prefix $PREFIX"
    else
        say "not running (no namespaces of prefix $PREFIX)"
    fi
}

status() {
    command -v ip >/dev/null || bad "ip not found; install iproute2 (apt-get install -y iproute2)"
    local namespaces n i=0
    namespaces=$(our_namespaces)
    if [[ -z $namespaces ]]; then
        say "not running (no namespaces of prefix $PREFIX)"
        exit 3
    fi
    [[ -f $(state_file) ]] && say "$(tr '\n' ' ' <"$(state_file)")"
    for n in $namespaces; do
        i=${n##*-node}
        say "$n: $(ip -n "$n" -4 -o addr show dev "$IFNAME" 2>/dev/null | awk '{print $4}')," \
            "$(ip netns pids "$n" 2>/dev/null | wc -l) process(es)"
        ip netns exec "$n" tc qdisc show dev "$IFNAME" 2>/dev/null | sed 's/^/    egress: /' || true
        tc qdisc show dev "${PREFIX}-v$i" 2>/dev/null | sed 's/^/    ingress: /' || true
    done
}

print_env() {
    local state addrs="" names="" i
    state=$(state_file)
    [[ -f $state && -n $(our_namespaces) ]] || die "not running (no nodes of prefix $PREFIX); run: $0 start --nodes 2 --link 1gbit" 3
    # shellcheck disable=SC1090
    source "$state"
    for ((i = 0; i < PPSIM_NODES; i++)); do
        addrs+="${addrs:+,}$(addr "$i")"
        names+="${names:+,}$(ns "$i")"
    done
    echo "export PPSIM_CLUSTER_PREFIX=$PREFIX"
    echo "export PPSIM_NODES=$PPSIM_NODES"
    echo "export PPSIM_LINK=$PPSIM_LINK"
    echo "export PPSIM_DELAY=$PPSIM_DELAY"
    echo "export PPSIM_NODE_NAMES=$names"
    echo "export PPSIM_NODE_ADDRS=$addrs"
    echo "export PPSIM_NODE_IFNAME=$IFNAME"
    echo "export MASTER_ADDR=$(addr 0)"
}

do_exec() {
    local node=$1
    shift
    [[ $node =~ ^[0-9]+$ ]] || bad "exec $node: NODE is a node number (e.g. exec 0 -- hostname)"
    (($# > 0)) || bad "exec $node: no command; e.g. $0 exec $node -- ip addr"
    node=$((10#$node))
    [[ $(id -u) == 0 ]] || bad "must run as root (ip netns exec needs CAP_SYS_ADMIN)"
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$(ns "$node")" \
        || die "node $node ($(ns "$node")) does not exist; run: $0 start --nodes N --link RATE" 3
    exec ip netns exec "$(ns "$node")" env GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$IFNAME}" \
        PPSIM_NODE_RANK="$node" PPSIM_NODE_ADDR="$(addr "$node")" "$@"
}

cmd=${1:-}
(($#)) && shift
if [[ $cmd == exec ]]; then
    (($#)) || bad "exec needs NODE -- CMD...; e.g. $0 exec 0 -- ip addr"
    node=$1
    shift
    while (($#)); do
        case $1 in
            --prefix) PREFIX=${2:-}; shift 2 || bad "--prefix needs a value" ;;
            --) shift; break ;;
            *) break ;;
        esac
    done
    check_prefix
    do_exec "$node" "$@"
fi
while (($#)); do
    case $1 in
        --nodes) NODES=${2:-}; shift 2 || bad "--nodes needs a value (e.g. --nodes 2)" ;;
        --link) LINK=${2:-}; shift 2 || bad "--link needs a value (e.g. --link 1gbit)" ;;
        --delay) DELAY=${2:-}; shift 2 || bad "--delay needs a value (e.g. --delay 1ms)" ;;
        --prefix) PREFIX=${2:-}; shift 2 || bad "--prefix needs a value (e.g. --prefix ppsim)" ;;
        -h|--help) usage; exit 0 ;;
        *) bad "unknown argument '$1'; see $0 --help" ;;
    esac
done
check_prefix
case $cmd in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) print_env ;;
    -h|--help|help) usage ;;
    "") usage >&2; exit 2 ;;
    *) bad "unknown command '$cmd'; one of start, stop, status, exec, env (see $0 --help)" ;;
esac
