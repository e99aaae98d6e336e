/*
 * The Confluent Parallel Consumer as a system of sessionflow-bench.
 *
 * The harness's child process (bench/src/systems/parallel_consumer.rs) starts this with the run's
 * settings as key=value arguments. It consumes the run's topic with a Parallel Consumer in KEY
 * ordering (one record of a session in the handler at a time, sessions in parallel up to
 * maxConcurrency threads), runs the bench handler on each record and measures it exactly as the
 * Rust handler (bench/src/handler.rs) does for the other systems: the same per-session order
 * check, the same fault decisions (the same splitmix draw, the same failing session window),
 * the same log-linear latency histogram (bench/src/measurement.rs's buckets), latency from the
 * producer's stamp in the value to the end of the successful call. A failed attempt throws
 * PCRetriableException, and PC retries the record after the delay the engine's RetryPolicy
 * gives (exponential, full jitter) while the session's later records wait (KEY ordering).
 *
 * Protocol, one line each, on stdout (to the Rust child, which feeds its Core with them):
 *   W <partition>                    a warm-up record of that partition arrived
 *   S <handled> <healthy> <attempts> <first_us> <last_us> <violations> <hist> ; <healthy hist>
 *                                    every 5 ms: counters (absolute; first_us 0 = none yet),
 *                                    then the histograms' buckets that grew since the last S
 *                                    line, as bucket:delta pairs
 * and on stdin (from it): `GO <µs>` (the paced load started), `STOP` (close and exit).
 *
 * commit_mode=async (the default) commits with PC's default, periodic asynchronous consumer
 * commits; commit_mode=transactional with its transactional mode (PERIODIC_TRANSACTIONAL_PRODUCER).
 */
package sessionflow.bench;

import io.confluent.parallelconsumer.PCRetriableException;
import io.confluent.parallelconsumer.ParallelConsumerOptions;
import io.confluent.parallelconsumer.ParallelConsumerOptions.CommitMode;
import io.confluent.parallelconsumer.ParallelConsumerOptions.ProcessingOrder;
import io.confluent.parallelconsumer.ParallelStreamProcessor;
import io.confluent.parallelconsumer.PollContext;
import io.confluent.parallelconsumer.RecordContext;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicLongArray;
import java.util.concurrent.locks.LockSupport;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public final class ParallelConsumerBench {
    /** bench/src/measurement.rs: 64 sub-buckets per octave, 40 octaves. */
    static final int SUB = 64;
    static final int BUCKETS = SUB * 40;
    /** bench/src/workload.rs: timestamp (8), session index (4), flags (4). */
    static final int PREFIX = 16;
    static final int FLAG_WARMUP = 1;
    static final String SEQ_HEADER = "sessionflow-seq";

    final Map<String, String> args;
    final long ioNanos;
    final double transientRate;
    final long seed;
    final long failSid;
    final long failFromMs;
    final long failForMs;
    final double retryInitialMs;
    final double retryMaxMs;

    final AtomicLongArray order;
    final AtomicLong violations = new AtomicLong();
    final AtomicLongArray all = new AtomicLongArray(BUCKETS);
    final AtomicLongArray healthy = new AtomicLongArray(BUCKETS);
    final AtomicLong handled = new AtomicLong();
    final AtomicLong healthyHandled = new AtomicLong();
    final AtomicLong attempts = new AtomicLong();
    final AtomicLong firstUs = new AtomicLong(Long.MAX_VALUE);
    final AtomicLong lastUs = new AtomicLong();
    final boolean[] warmSent;
    final AtomicLongArray warm;
    final AtomicLong loadStartedUs = new AtomicLong();
    final PrintStream out = new PrintStream(new java.io.FileOutputStream(java.io.FileDescriptor.out), false, StandardCharsets.UTF_8);

    ParallelConsumerBench(Map<String, String> args) {
        this.args = args;
        ioNanos = Long.parseLong(args.getOrDefault("io_ms", "0")) * 1_000_000L;
        transientRate = Double.parseDouble(args.getOrDefault("transient_rate", "0"));
        seed = Long.parseUnsignedLong(args.getOrDefault("seed", "0"));
        failSid = Long.parseLong(args.getOrDefault("fail_sid", "-1"));
        failFromMs = Long.parseLong(args.getOrDefault("fail_from_ms", "0"));
        failForMs = Long.parseLong(args.getOrDefault("fail_for_ms", "0"));
        retryInitialMs = Double.parseDouble(args.getOrDefault("retry_initial_ms", "1"));
        retryMaxMs = Double.parseDouble(args.getOrDefault("retry_max_ms", "100"));
        order = new AtomicLongArray(Integer.parseInt(args.get("sessions")));
        int partitions = Integer.parseInt(args.get("partitions"));
        warm = new AtomicLongArray(partitions);
        warmSent = new boolean[partitions];
    }

    static long nowUs() {
        java.time.Instant t = java.time.Instant.now();
        return t.getEpochSecond() * 1_000_000L + t.getNano() / 1_000;
    }

    static int bucketIndex(long v) {
        int msb = 63 - Long.numberOfLeadingZeros(v | 1);
        int shift = Math.max(0, msb - Integer.numberOfTrailingZeros(SUB));
        long i = (long) SUB * shift + (v >>> shift);
        return (int) Math.min(i, BUCKETS - 1);
    }

    /** handler.rs's draw: splitmix64's finaliser over the mix, a uniform value in [0, 1). */
    static double draw(long seed, long sid, long seq, long attempt) {
        long z = seed ^ (sid * 0x9e3779b97f4a7c15L) ^ (seq * 0xc2b2ae3d27d4eb4fL) ^ (attempt * 0x165667b19e3779f9L);
        z = (z ^ (z >>> 30)) * 0xbf58476d1ce4e5b9L;
        z = (z ^ (z >>> 27)) * 0x94d049bb133111ebL;
        z ^= z >>> 31;
        return (double) (z >>> 11) / (double) (1L << 53);
    }

    /** measurement.rs's OrderCheck::enter. */
    void enter(int sid, long seq, int attempt) {
        if (sid < 0 || sid >= order.length()) {
            violations.incrementAndGet();
            return;
        }
        long prev = Math.max(seq - 1, 0);
        long expected = attempt <= 1 ? prev << 1 : (prev << 1) | 1;
        if (order.getAndSet(sid, (prev << 1) | 1) != expected) violations.incrementAndGet();
    }

    /** measurement.rs's OrderCheck::finish. */
    void finishOrder(int sid, long seq) {
        if (sid < 0 || sid >= order.length()) {
            violations.incrementAndGet();
            return;
        }
        long inside = (Math.max(seq - 1, 0) << 1) | 1;
        if (order.getAndSet(sid, seq << 1) != inside) violations.incrementAndGet();
    }

    boolean fails(int sid, long seq, int attempt) {
        if (transientRate > 0 && draw(seed, sid, seq, attempt) < transientRate) return true;
        if (failSid == sid) {
            long started = loadStartedUs.get();
            long from = started + failFromMs * 1_000;
            long until = from + failForMs * 1_000;
            long now = nowUs();
            return started > 0 && now >= from && now < until;
        }
        return false;
    }

    /** The bench handler (handler.rs's Core::call) on one record, attempt `attempt`. */
    void handle(RecordContext<byte[], byte[]> rc) {
        ConsumerRecord<byte[], byte[]> r = rc.getConsumerRecord();
        byte[] v = r.value();
        if (v == null || v.length < PREFIX) return;
        ByteBuffer b = ByteBuffer.wrap(v).order(ByteOrder.LITTLE_ENDIAN);
        long producedUs = b.getLong(0);
        int sid = b.getInt(8);
        int flags = b.getInt(12);
        if ((flags & FLAG_WARMUP) != 0) {
            warm.set(r.partition(), 1);
            return;
        }
        Header h = r.headers().lastHeader(SEQ_HEADER);
        if (h == null || h.value() == null) return;
        long seq = Long.parseLong(new String(h.value(), StandardCharsets.UTF_8));
        int attempt = rc.getNumberOfFailedAttempts() + 1;
        attempts.incrementAndGet();
        if (attempt == 1) firstUs.accumulateAndGet(nowUs(), Math::min);
        enter(sid, seq, attempt);
        if (ioNanos > 0) {
            // The handler's I/O: this thread waits, as a blocking client call would.
            long until = System.nanoTime() + ioNanos;
            for (long left = ioNanos; left > 0; left = until - System.nanoTime()) LockSupport.parkNanos(left);
        }
        if (fails(sid, seq, attempt)) throw new PCRetriableException("injected transient fault, attempt " + attempt);
        finishOrder(sid, seq);
        long done = nowUs();
        long latency = Math.max(0, done - producedUs);
        all.incrementAndGet(bucketIndex(latency));
        if (failSid != sid) {
            healthy.incrementAndGet(bucketIndex(latency));
            healthyHandled.incrementAndGet();
        }
        lastUs.accumulateAndGet(done, Math::max);
        handled.incrementAndGet();
    }

    /** RetryPolicy::delay: a full-jitter share of min(initial × 2^(failures − 1), max). */
    Duration retryDelay(RecordContext<byte[], byte[]> rc) {
        int failures = Math.max(1, rc.getNumberOfFailedAttempts());
        double ceiling = Math.min(retryInitialMs * Math.pow(2.0, Math.min(failures - 1, 1_000)), retryMaxMs);
        double ms = ceiling * ThreadLocalRandom.current().nextDouble();
        return Duration.ofNanos((long) (ms * 1e6));
    }

    /** One S line (and W lines for partitions newly warm); `last` holds what was sent before. */
    void report(long[] lastAll, long[] lastHealthy) {
        for (int p = 0; p < warmSent.length; p++) {
            if (!warmSent[p] && warm.get(p) != 0) {
                warmSent[p] = true;
                out.println("W " + p);
            }
        }
        // Counters first, histograms after: every record counted is in the histograms sent.
        long h = handled.get(), hh = healthyHandled.get(), a = attempts.get();
        long first = firstUs.get(), last = lastUs.get(), viol = violations.get();
        StringBuilder s = new StringBuilder(64);
        s.append("S ").append(h).append(' ').append(hh).append(' ').append(a).append(' ')
                .append(first == Long.MAX_VALUE ? 0 : first).append(' ').append(last).append(' ').append(viol);
        deltas(all, lastAll, s);
        s.append(" ;");
        deltas(healthy, lastHealthy, s);
        out.println(s);
        out.flush();
    }

    static void deltas(AtomicLongArray hist, long[] last, StringBuilder s) {
        for (int i = 0; i < BUCKETS; i++) {
            long n = hist.get(i);
            if (n != last[i]) {
                s.append(' ').append(i).append(':').append(n - last[i]);
                last[i] = n;
            }
        }
    }

    void run() throws Exception {
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, args.get("brokers"));
        props.put(ConsumerConfig.GROUP_ID_CONFIG, args.get("group"));
        props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        props.put(ConsumerConfig.FETCH_MAX_WAIT_MS_CONFIG, args.getOrDefault("fetch_wait_ms", "10"));
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        // commit_mode=transactional: PC's transactional mode, offsets sent with a transaction of
        // its one producer every commit interval; the consumer reads committed data only.
        boolean transactional = args.getOrDefault("commit_mode", "async").equals("transactional");
        if (transactional) props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props);
        ParallelConsumerOptions.ParallelConsumerOptionsBuilder<byte[], byte[]> builder =
                ParallelConsumerOptions.<byte[], byte[]>builder().consumer(consumer);
        if (transactional) {
            Properties p = new Properties();
            p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args.get("brokers"));
            p.put(ProducerConfig.TRANSACTIONAL_ID_CONFIG, args.get("group") + ".pc-tx");
            p.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
            p.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
            builder = builder.producer(new KafkaProducer<>(p))
                    .commitMode(CommitMode.PERIODIC_TRANSACTIONAL_PRODUCER);
        } else {
            builder = builder.commitMode(CommitMode.PERIODIC_CONSUMER_ASYNCHRONOUS);
        }
        ParallelConsumerOptions<byte[], byte[]> options = builder
                .ordering(ProcessingOrder.KEY)
                .commitInterval(Duration.ofMillis(Long.parseLong(args.getOrDefault("commit_interval_ms", "1000"))))
                .maxConcurrency(Integer.parseInt(args.get("max_concurrency")))
                .retryDelayProvider(this::retryDelay)
                .build();
        ParallelStreamProcessor<byte[], byte[]> pc = ParallelStreamProcessor.createEosStreamProcessor(options);
        pc.subscribe(List.of(args.get("topic")));
        pc.poll((PollContext<byte[], byte[]> ctx) -> handle(ctx.getSingleRecord()));

        Thread reporter = new Thread(() -> {
            long[] lastAll = new long[BUCKETS], lastHealthy = new long[BUCKETS];
            while (!Thread.currentThread().isInterrupted()) {
                report(lastAll, lastHealthy);
                LockSupport.parkNanos(5_000_000L);
            }
        }, "bench-reporter");
        reporter.setDaemon(true);
        reporter.start();

        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            line = line.trim();
            if (line.startsWith("GO ")) loadStartedUs.set(Long.parseLong(line.substring(3).trim()));
            else if (line.equals("STOP")) break;
        }
        reporter.interrupt();
        pc.closeDontDrainFirst();
        out.flush();
        System.exit(0);
    }

    /** The values bench/src/handler.rs's the_java_twin_shares_these_draws_and_buckets pins. */
    static void selfCheck() {
        double[] draws = {draw(7, 3, 17, 2), draw(13, 9, 50_000, 1)};
        double[] wantDraws = {0.9332074446829549, 0.1735520976621442};
        long[] values = {0, 127, 128, 1_000, 5_000, 123_456, 1L << 44};
        int[] wantBuckets = {0, 127, 128, 317, 462, 760, 2_496};
        for (int i = 0; i < draws.length; i++) {
            if (draws[i] != wantDraws[i]) throw new IllegalStateException("draw " + i + ": " + draws[i]);
        }
        for (int i = 0; i < values.length; i++) {
            if (bucketIndex(values[i]) != wantBuckets[i]) {
                throw new IllegalStateException("bucket of " + values[i] + ": " + bucketIndex(values[i]));
            }
        }
    }

    public static void main(String[] argv) throws Exception {
        selfCheck();
        Map<String, String> args = new HashMap<>();
        for (String a : argv) {
            int eq = a.indexOf('=');
            if (eq > 0) args.put(a.substring(0, eq), a.substring(eq + 1));
        }
        for (String k : List.of("brokers", "topic", "group", "partitions", "sessions", "max_concurrency")) {
            if (!args.containsKey(k)) throw new IllegalArgumentException("missing argument " + k + "=…");
        }
        new ParallelConsumerBench(args).run();
    }
}
