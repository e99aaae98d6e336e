#!/usr/bin/env bash
# Apache Kafka on this machine, in KRaft mode: the test broker, the chaos cluster, the bench's
# broker. Kafka itself, not a stand-in: its jars are resolved with Maven from Maven Central into
# the cache and run by the machine's JDK (17+).
#
#   scripts/kafka.sh install
#       resolve org.apache.kafka:kafka_2.13:$KAFKA_VERSION and its dependencies (plus a log4j2
#       binding) into ~/.cache/sessionflow/kafka-<version>/libs, compile the readiness probe;
#       idempotent (a second call does nothing), ~10 s with a warm Maven cache
#   scripts/kafka.sh start --port P [--nodes N] [--sasl-ssl] [--proxied] [--set KEY=VALUE]…
#       start N (default 1) combined broker+controller nodes on 127.0.0.1, node i (0-based) on
#         P+4i    its client listener (PLAINTEXT; SASL_SSL with --sasl-ssl)
#         P+4i+1  its controller listener
#         P+4i+2  its inter-broker listener (PLAINTEXT)
#         P+4i+3  with --proxied: the client address it advertises, where a network-fault proxy
#                 (toxiproxy, started by whoever asked for it) forwards to P+4i
#       wait until the cluster serves metadata and creates (then deletes) a topic with
#       replication factor N, and print the bootstrap list (127.0.0.1:P,…; the advertised
#       addresses) as the last line of stdout. The nodes keep running in the background.
#       --sasl-ssl: the client listener speaks SASL_SSL with SCRAM-SHA-512 and a certificate
#       signed by a CA made here; the CA, the users and a client properties file are in
#       $(state P)/secure/ (`scripts/kafka.sh secure-dir --port P` prints the folder).
#       --set KEY=VALUE: a broker setting of every node, over this script's (a test of a
#       misconfigured broker); repeatable.
#   scripts/kafka.sh stop --port P       stop the nodes started with that port, delete their data
#   scripts/kafka.sh status --port P     exit 0 when node 0's client port answers
#   scripts/kafka.sh pid --port P --node I   print node I's pid (faults: kill, SIGSTOP)
#   scripts/kafka.sh restart-node --port P --node I   start node I again (after a kill)
#
# Internal topics get the replication factor N and min.insync.replicas max(1, N-1), so a
# 3-node cluster keeps serving transactions and commits with one node down. Heaps are small
# (KAFKA_HEAP, default 384m per node for N>1, 512m for one node): 3 nodes fit 2 cores and
# 24 GiB beside the workers. State (configs, data, logs, pids) lives in .local/kafka-P/.
set -euo pipefail

KAFKA_VERSION=${KAFKA_VERSION:-4.1.1}
LOG4J_VERSION=2.24.3
SLF4J_VERSION=2.0.17
CACHE=${SESSIONFLOW_CACHE:-$HOME/.cache/sessionflow}
ROOT="$CACHE/kafka-$KAFKA_VERSION"
LIBS="$ROOT/libs"
here=$(cd "$(dirname "$0")/.." && pwd)
STATE_ROOT=${SESSIONFLOW_STATE:-$here/.local}
# The cluster-wide SCRAM user of --sasl-ssl clusters (what tests and tools log in with).
SCRAM_USER=sessionflow
SCRAM_PASSWORD=sessionflow-secret

say() { echo "kafka.sh: $*" >&2; }
die() { say "$*"; exit 1; }
answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# --- install ----------------------------------------------------------------------------------
install() {
  if [[ -f "$ROOT/.installed" ]]; then return 0; fi
  command -v java >/dev/null || die "java is needed (Kafka 4 runs on Java 17+)"
  command -v javac >/dev/null || die "javac is needed (the readiness probe is compiled once)"
  command -v mvn >/dev/null || die "mvn is needed (Kafka's jars come from Maven Central)"
  local jv
  jv=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)
  ((jv >= 17)) || die "Kafka $KAFKA_VERSION needs Java 17 or newer; this java is $jv"
  say "resolving Apache Kafka $KAFKA_VERSION from Maven Central into $ROOT"
  local work
  work=$(mktemp -d)
  mkdir -p "$ROOT"
  cat >"$work/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.sessionflow</groupId>
  <artifactId>kafka-runtime</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>$SLF4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId><version>$LOG4J_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>$LOG4J_VERSION</version></dependency>
  </dependencies>
</project>
EOF
  rm -rf "$LIBS.partial"
  mvn -B -q -f "$work/pom.xml" dependency:copy-dependencies -DoutputDirectory="$LIBS.partial" >&2 \
    || die "Maven could not resolve org.apache.kafka:kafka_2.13:$KAFKA_VERSION"
  rm -rf "$LIBS"
  mv "$LIBS.partial" "$LIBS"
  cat >"$ROOT/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = out
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
EOF
  mkdir -p "$ROOT/probe"
  javac -d "$ROOT/probe" -cp "$LIBS/*" "$here/scripts/kafka/Ready.java" >&2
  rm -rf "$work"
  touch "$ROOT/.installed"
  say "installed Apache Kafka $KAFKA_VERSION ($(du -sh "$LIBS" | cut -f1))"
}

# --- one cluster's files ----------------------------------------------------------------------
PORT=""
NODES=1
SASL_SSL=0
PROXIED=0
NODE=""
SETTINGS=()
parse() {
  while (($#)); do
    case "$1" in
      --port) PORT=$2; shift 2 ;;
      --nodes) NODES=$2; shift 2 ;;
      --node) NODE=$2; shift 2 ;;
      --sasl-ssl) SASL_SSL=1; shift ;;
      --proxied) PROXIED=1; shift ;;
      --set)
        [[ ${2:-} =~ ^[a-z][a-z0-9._-]*=.*$ ]] || { say "--set needs KEY=VALUE, not '${2:-}'"; exit 2; }
        SETTINGS+=("$2"); shift 2 ;;
      *) say "unknown argument $1"; exit 2 ;;
    esac
  done
  [[ $PORT =~ ^[0-9]+$ ]] || { say "--port P is required"; exit 2; }
  [[ $NODES =~ ^[1-9]$ ]] || { say "--nodes must be 1..9"; exit 2; }
  STATE="$STATE_ROOT/kafka-$PORT"
}
client_port() { echo $((PORT + 4 * $1)); }
controller_port() { echo $((PORT + 4 * $1 + 1)); }
internal_port() { echo $((PORT + 4 * $1 + 2)); }
advertised_port() { if ((PROXIED)); then echo $((PORT + 4 * $1 + 3)); else client_port "$1"; fi; }
bootstrap() {
  local i list=()
  for ((i = 0; i < NODES; i++)); do list+=("127.0.0.1:$(advertised_port "$i")"); done
  (IFS=,; echo "${list[*]}")
}
# jvm ARGS…: Kafka's JVM. Serial GC and two JIT threads: a broker here shares 2 cores with the
# tests and the workers.
jvm_args() {
  local heap=${KAFKA_HEAP:-$( ((NODES > 1)) && echo 384m || echo 512m)}
  JVM=(java "-Xms${heap}" "-Xmx${heap}" -XX:+UseSerialGC -XX:CICompilerCount=2
    -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true
    "-Dlog4j2.configurationFile=$ROOT/log4j2.properties" -cp "$LIBS/*")
}
jvm() { jvm_args; "${JVM[@]}" "$@"; }

# make_secure: a CA, the brokers' certificate (127.0.0.1, localhost), a PKCS12 keystore, and
# the client settings a test hands to librdkafka.
make_secure() {
  local dir="$STATE/secure"
  mkdir -p "$dir"
  command -v openssl >/dev/null || die "openssl is needed for --sasl-ssl"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=sessionflow test CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$dir/broker.key" \
    -out "$dir/broker.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' \
    >"$dir/broker.ext"
  openssl x509 -req -in "$dir/broker.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 2 -extfile "$dir/broker.ext" -out "$dir/broker.pem" 2>/dev/null
  openssl pkcs12 -export -in "$dir/broker.pem" -inkey "$dir/broker.key" -certfile "$dir/ca.pem" \
    -name broker -passout pass:keystore-pass -out "$dir/broker.p12"
  cat >"$dir/client.properties" <<EOF
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.username=$SCRAM_USER
sasl.password=$SCRAM_PASSWORD
ssl.ca.location=$dir/ca.pem
EOF
  chmod 600 "$dir"/*.key "$dir/client.properties"
}

write_config() {
  local i=$1
  local dir="$STATE/node-$i" voters=() j isr
  for ((j = 0; j < NODES; j++)); do voters+=("$((j + 1))@127.0.0.1:$(controller_port "$j")"); done
  isr=$((NODES > 1 ? NODES - 1 : 1))
  mkdir -p "$dir"
  local client_proto=PLAINTEXT
  ((SASL_SSL)) && client_proto=SASL_SSL
  {
    echo "process.roles=broker,controller"
    echo "node.id=$((i + 1))"
    echo "controller.quorum.voters=$(IFS=,; echo "${voters[*]}")"
    echo "listeners=CLIENT://127.0.0.1:$(client_port "$i"),CONTROLLER://127.0.0.1:$(controller_port "$i"),INTERNAL://127.0.0.1:$(internal_port "$i")"
    echo "advertised.listeners=CLIENT://127.0.0.1:$(advertised_port "$i"),INTERNAL://127.0.0.1:$(internal_port "$i")"
    echo "controller.listener.names=CONTROLLER"
    echo "inter.broker.listener.name=INTERNAL"
    echo "listener.security.protocol.map=CLIENT:$client_proto,CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT"
    echo "log.dirs=$dir/data"
    echo "num.partitions=1"
    echo "default.replication.factor=$NODES"
    echo "min.insync.replicas=$isr"
    echo "offsets.topic.replication.factor=$NODES"
    echo "offsets.topic.num.partitions=10"
    echo "transaction.state.log.replication.factor=$NODES"
    echo "transaction.state.log.min.isr=$isr"
    echo "transaction.state.log.num.partitions=10"
    echo "group.initial.rebalance.delay.ms=0"
    # Tests use 6 s session timeouts under both group protocols (KIP-848: the broker's).
    echo "group.consumer.session.timeout.ms=6000"
    echo "group.consumer.min.session.timeout.ms=6000"
    echo "group.consumer.heartbeat.interval.ms=500"
    echo "group.consumer.min.heartbeat.interval.ms=500"
    echo "auto.create.topics.enable=false"
    echo "delete.topic.enable=true"
    echo "num.network.threads=2"
    echo "num.io.threads=4"
    echo "background.threads=2"
    echo "log.cleaner.threads=1"
    echo "log.cleaner.dedupe.buffer.size=8388608"
    echo "log.segment.bytes=67108864"
    echo "log.retention.check.interval.ms=60000"
    # A restarted node rejoins fast: its replicas catch up from the others' logs.
    echo "unclean.leader.election.enable=false"
    echo "replica.lag.time.max.ms=10000"
    if ((SASL_SSL)); then
      echo "sasl.enabled.mechanisms=SCRAM-SHA-512"
      echo "listener.name.client.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;"
      echo "ssl.keystore.type=PKCS12"
      echo "ssl.keystore.location=$STATE/secure/broker.p12"
      echo "ssl.keystore.password=keystore-pass"
      echo "ssl.key.password=keystore-pass"
    fi
    # Last: a later line of a properties file wins.
    local setting
    for setting in "${SETTINGS[@]}"; do echo "$setting"; done
  } >"$dir/server.properties"
}

node_pid_file() { echo "$STATE/node-$1/pid"; }
# node_alive I: node I's JVM runs (an exited one not yet reaped, a zombie, does not count).
node_alive() {
  local f pid
  f=$(node_pid_file "$1")
  [[ -s $f ]] || return 1
  pid=$(cat "$f")
  kill -0 "$pid" 2>/dev/null || return 1
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

launch_node() {
  local i=$1
  local dir="$STATE/node-$i"
  jvm_args
  # In a session of its own (a test runner's signal to its process group does not reach the
  # broker); the pid written is the JVM's, whether or not setsid forked.
  setsid bash -c 'echo $$ >"$0"; exec "$@"' "$(node_pid_file "$i")" "${JVM[@]}" kafka.Kafka \
    "$dir/server.properties" </dev/null >>"$dir/kafka.log" 2>&1 &
  local f
  f=$(node_pid_file "$i")
  for _ in $(seq 1 50); do [[ -s $f ]] && break; sleep 0.05; done
}

start() {
  parse "$@"
  if answers "$(client_port 0)"; then
    if [[ -f "$STATE/bootstrap" ]]; then
      say "a cluster already answers on port $PORT; using it"
      cat "$STATE/bootstrap"
      return 0
    fi
    die "something that is not a cluster of this script answers on 127.0.0.1:$PORT"
  fi
  install
  local i p
  for ((i = 0; i < NODES; i++)); do
    for p in $(client_port "$i") $(controller_port "$i") $(internal_port "$i"); do
      answers "$p" && die "port $p is taken (node $i of a cluster on $PORT)"
    done
  done
  rm -rf "$STATE"
  mkdir -p "$STATE"
  ((SASL_SSL)) && make_secure
  local cluster_id
  cluster_id=$(jvm kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n1)
  for ((i = 0; i < NODES; i++)); do
    write_config "$i"
    local scram=()
    ((SASL_SSL)) && scram=(--add-scram "SCRAM-SHA-512=[name=$SCRAM_USER,password=$SCRAM_PASSWORD]")
    jvm kafka.tools.StorageTool format -t "$cluster_id" -c "$STATE/node-$i/server.properties" \
      "${scram[@]}" >"$STATE/node-$i/format.log" 2>&1 \
      || { cat "$STATE/node-$i/format.log" >&2; die "formatting node $i failed"; }
    launch_node "$i"
  done
  echo "$NODES" >"$STATE/nodes"
  echo "$PROXIED" >"$STATE/proxied"
  echo "$SASL_SSL" >"$STATE/sasl_ssl"
  wait_ready
  bootstrap >"$STATE/bootstrap"
  say "Apache Kafka $KAFKA_VERSION: $NODES node(s) ready on port $PORT (state $STATE)"
  bootstrap
}

# wait_ready: every node's client port answers, then the probe creates and deletes a topic with
# replication factor N through node 0's own listener (the proxy, if any, may not run yet).
wait_ready() {
  local i deadline=$((SECONDS + 120))
  for ((i = 0; i < NODES; i++)); do
    until answers "$(client_port "$i")"; do
      node_alive "$i" || { tail -n 40 "$STATE/node-$i/kafka.log" >&2; die "node $i exited"; }
      ((SECONDS < deadline)) || die "node $i did not listen within 120 s"
      sleep 0.2
    done
  done
  local props=()
  ((SASL_SSL)) && props=("$STATE/secure/client.properties")
  local direct=() 
  for ((i = 0; i < NODES; i++)); do direct+=("127.0.0.1:$(client_port "$i")"); done
  until java -Xmx96m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC \
    "-Dlog4j2.configurationFile=$ROOT/log4j2.properties" -cp "$ROOT/probe:$LIBS/*" Ready \
    "$(IFS=,; echo "${direct[*]}")" "$NODES" "${props[@]}" >>"$STATE/ready.log" 2>&1; do
    ((SECONDS < deadline)) || { tail -n 20 "$STATE/ready.log" >&2; die "the cluster did not serve a topic with replication factor $NODES within 120 s"; }
    sleep 0.5
  done
}

load_state() {
  [[ -f "$STATE/nodes" ]] || return 1
  NODES=$(cat "$STATE/nodes")
  PROXIED=$(cat "$STATE/proxied" 2>/dev/null || echo 0)
  SASL_SSL=$(cat "$STATE/sasl_ssl" 2>/dev/null || echo 0)
}

stop() {
  parse "$@"
  load_state || { say "no cluster of this script on port $PORT"; return 0; }
  local i pid pids=()
  for ((i = 0; i < NODES; i++)); do
    if node_alive "$i"; then
      pid=$(cat "$(node_pid_file "$i")")
      kill -CONT "$pid" 2>/dev/null || true
      kill -KILL "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  rm -rf "$STATE"
  say "stopped the cluster on port $PORT and deleted its data"
}

case "${1:-}" in
  install) install ;;
  start) shift; start "$@" ;;
  stop) shift; stop "$@" ;;
  status) shift; parse "$@"; answers "$(client_port 0)" ;;
  bootstrap) shift; parse "$@"; cat "$STATE/bootstrap" ;;
  secure-dir) shift; parse "$@"; echo "$STATE/secure" ;;
  pid) shift; parse "$@"; cat "$(node_pid_file "${NODE:?--node I}")" ;;
  restart-node)
    shift; parse "$@"; load_state || die "no cluster on port $PORT"
    node_alive "${NODE:?--node I}" && die "node $NODE still runs"
    launch_node "$NODE"
    ;;
  *) echo "usage: $0 install | start --port P [--nodes N] [--sasl-ssl] [--proxied] [--set KEY=VALUE]… | stop --port P | status --port P" >&2; exit 2 ;;
esac
