package publisher_test

import (
	"crypto/rand"
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/publisher"
)

// TestMurmur2KafkaVectors checks Murmur2 against the expected values of the
// Apache Kafka Java client's UtilsTest.testMurmur2 (clients/src/test/java/
// org/apache/kafka/common/utils/UtilsTest.java), which ports in other
// languages (kafka_ex, kafkabr) copy verbatim.
func TestMurmur2KafkaVectors(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]int32{
		"21":                         -973932308,
		"foobar":                     -790332482,
		"a-little-bit-long-string":   -985981536,
		"a-little-bit-longer-string": -1486304829,
		"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
		"abc": 479470107,
		// Not in UtilsTest: reference values of other ports checked against
		// the Java client (librdkafka's rdmurmur2.c, akka's Murmur2Spec).
		"":      275646681,
		"kafka": -798503068,
		"1":     -1993445489,
		"12345": -1188365604,
	} {
		require.Equal(t, want, publisher.Murmur2([]byte(in)), "murmur2(%q)", in)
	}
}

func TestKeyPartitionIsToPositiveModulo(t *testing.T) {
	t.Parallel()
	for _, n := range []int32{1, 2, 3, 7, 12, 100} {
		for _, key := range []string{"", "21", "foobar", "abc", "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"} {
			h := publisher.Murmur2([]byte(key))
			want := (h & 0x7fffffff) % n // Utils.toPositive(murmur2(key)) % numPartitions
			require.Equal(t, want, publisher.KeyPartition([]byte(key), n))
		}
	}
	// A negative hash is made positive by masking the sign bit, not abs():
	// the two disagree for "21" on 7 partitions.
	h := publisher.Murmur2([]byte("21"))
	require.Negative(t, h)
	require.Equal(t, (h&0x7fffffff)%7, publisher.KeyPartition([]byte("21"), 7))
	require.NotEqual(t, (-h)%7, publisher.KeyPartition([]byte("21"), 7))
}

// TestKeyPartitionMatchesSarama cross-checks against sarama's own
// Java-compatible murmur2 partitioner.
func TestKeyPartitionMatchesSarama(t *testing.T) {
	t.Parallel()
	sp := sarama.NewMurmur2Partitioner("t")
	for i := range 1000 {
		key := make([]byte, i%37)
		_, _ = rand.Read(key)
		for _, n := range []int32{1, 3, 16, 101} {
			want, err := sp.Partition(&sarama.ProducerMessage{Key: sarama.ByteEncoder(key)}, n)
			require.NoError(t, err)
			require.Equal(t, want, publisher.KeyPartition(key, n), fmt.Sprintf("key %x, %d partitions", key, n))
		}
	}
}
