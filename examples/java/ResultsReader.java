// A consumer of agentruns in Java: the Avro library's BinaryMessageDecoder reads the records as
// they are on the topic (single-object encoding), with the schema files of schemas/.
//
//   java -cp 'lib/*' ResultsReader.java run-id PARTITIONS KEY...
//       the run each idempotency key names, and its partition (docs/contract.md)
//   java -cp 'lib/*' ResultsReader.java results BOOTSTRAP TOPIC SCHEMA_DIR RUN_ID TIMEOUT_S
//       the committed Result records of RUN_ID, one tab-separated line each:
//       partition, the partition the key hashes to, run_id, status, summary, body
//
// lib/ holds the jars of pom.xml: mvn dependency:copy-dependencies -DoutputDirectory=lib

import java.io.File;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.HexFormat;
import java.util.List;
import java.util.Properties;
import java.util.UUID;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.utils.Utils;

public class ResultsReader {
    static final UUID RUN_NAMESPACE = UUID.fromString("6f1d3a52-2b8e-5c1e-9a43-61676e747275");

    /** "run-" + uuid5(RUN_NAMESPACE, key) as 32 hex digits (Java's UUID has no version 5). */
    static String runIdForKey(String key) throws Exception {
        ByteBuffer namespace = ByteBuffer.allocate(16);
        namespace.putLong(RUN_NAMESPACE.getMostSignificantBits());
        namespace.putLong(RUN_NAMESPACE.getLeastSignificantBits());
        MessageDigest sha1 = MessageDigest.getInstance("SHA-1");
        sha1.update(namespace.array());
        sha1.update(key.getBytes(StandardCharsets.UTF_8));
        byte[] id = Arrays.copyOf(sha1.digest(), 16);
        id[6] = (byte) ((id[6] & 0x0f) | 0x50); // version 5
        id[8] = (byte) ((id[8] & 0x3f) | 0x80); // RFC 4122 variant
        return "run-" + HexFormat.of().formatHex(id);
    }

    /** Kafka's default partitioner for a key: what every record of a run is produced with. */
    static int partitionFor(String runId, int partitions) {
        return Utils.toPositive(Utils.murmur2(runId.getBytes(StandardCharsets.UTF_8))) % partitions;
    }

    /** A decoder that reads every shipped version of a record, in the shape of the newest. */
    static BinaryMessageDecoder<GenericRecord> decoder(File dir, String name) throws Exception {
        Pattern file = Pattern.compile("agentruns\\." + name + "\\.v([0-9]+)\\.avsc");
        List<File> versions = new ArrayList<>();
        for (File f : dir.listFiles()) {
            if (file.matcher(f.getName()).matches()) versions.add(f);
        }
        versions.sort(Comparator.comparingInt(f -> version(file, f)));
        List<Schema> schemas = new ArrayList<>();
        for (File f : versions) schemas.add(new Schema.Parser().parse(f)); // one parser each
        Schema current = schemas.get(schemas.size() - 1);
        BinaryMessageDecoder<GenericRecord> decoder =
            new BinaryMessageDecoder<>(GenericData.get(), current);
        for (Schema older : schemas.subList(0, schemas.size() - 1)) decoder.addSchema(older);
        return decoder;
    }

    static int version(Pattern file, File f) {
        Matcher m = file.matcher(f.getName());
        m.matches();
        return Integer.parseInt(m.group(1));
    }

    static void results(String bootstrap, String topic, File schemas, String runId, long timeoutS)
            throws Exception {
        BinaryMessageDecoder<GenericRecord> decoder = decoder(schemas, "Result");
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        // Results are written in the processor's transactions: read only committed ones.
        props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class);
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class);
        try (KafkaConsumer<String, byte[]> consumer = new KafkaConsumer<>(props)) {
            List<TopicPartition> partitions = new ArrayList<>();
            for (PartitionInfo p : consumer.partitionsFor(topic)) {
                partitions.add(new TopicPartition(topic, p.partition()));
            }
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            long deadline = System.nanoTime() + Duration.ofSeconds(timeoutS).toNanos();
            boolean found = false;
            while (!found && System.nanoTime() < deadline) {
                for (ConsumerRecord<String, byte[]> r : consumer.poll(Duration.ofMillis(200))) {
                    GenericRecord result = decoder.decode(r.value());
                    if (!runId.equals(result.get("run_id").toString())) continue;
                    found = true;
                    System.out.println(String.join("\t",
                        String.valueOf(r.partition()),
                        String.valueOf(partitionFor(r.key(), partitions.size())),
                        result.get("run_id").toString(),
                        result.get("status").toString(),
                        String.valueOf(result.get("summary")),
                        result.get("body").toString()));
                }
            }
            if (!found) {
                System.err.println("no result of " + runId + " on " + topic);
                System.exit(1);
            }
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length >= 3 && args[0].equals("run-id")) {
            int partitions = Integer.parseInt(args[1]);
            for (String key : Arrays.asList(args).subList(2, args.length)) {
                String runId = runIdForKey(key);
                System.out.println(runId + "\t" + partitionFor(runId, partitions));
            }
        } else if (args.length == 6 && args[0].equals("results")) {
            results(args[1], args[2], new File(args[3]), args[4], Long.parseLong(args[5]));
        } else {
            System.err.println("usage: run-id PARTITIONS KEY..."
                + " | results BOOTSTRAP TOPIC SCHEMA_DIR RUN_ID TIMEOUT_S");
            System.exit(2);
        }
    }
}
