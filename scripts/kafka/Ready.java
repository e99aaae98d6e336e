// The readiness probe of scripts/kafka.sh: exits 0 once the cluster at the bootstrap list has
// the expected number of brokers and creates (then deletes) a topic with that replication
// factor, which is what a test needs before it makes its own topics.
//
//   java -cp 'probe:libs/*' Ready BOOTSTRAP NODES [client.properties]

import java.io.FileInputStream;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.TimeUnit;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.NewTopic;

public final class Ready {
    public static void main(String[] args) throws Exception {
        Properties props = new Properties();
        if (args.length > 2) {
            try (FileInputStream in = new FileInputStream(args[2])) {
                props.load(in);
            }
            // librdkafka's names for the CA and the SASL login, in Java's words.
            String ca = (String) props.remove("ssl.ca.location");
            if (ca != null) {
                props.put("ssl.truststore.type", "PEM");
                props.put("ssl.truststore.location", ca);
            }
            String user = (String) props.remove("sasl.username");
            String password = (String) props.remove("sasl.password");
            if (user != null) {
                props.put("sasl.jaas.config",
                    "org.apache.kafka.common.security.scram.ScramLoginModule required username=\""
                        + user + "\" password=\"" + password + "\";");
            }
        }
        int nodes = Integer.parseInt(args[1]);
        props.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        props.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "5000");
        props.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "10000");
        try (Admin admin = Admin.create(props)) {
            int seen = admin.describeCluster().nodes().get(10, TimeUnit.SECONDS).size();
            if (seen < nodes) {
                System.err.println("ready: " + seen + " of " + nodes + " brokers registered");
                System.exit(1);
            }
            String topic = "__sessionflow_ready_" + System.nanoTime();
            admin.createTopics(List.of(new NewTopic(topic, 1, (short) nodes)))
                .all().get(20, TimeUnit.SECONDS);
            admin.deleteTopics(List.of(topic)).all().get(20, TimeUnit.SECONDS);
        }
        System.out.println("ready");
    }
}
