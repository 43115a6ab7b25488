package publisher

import (
	"crypto/rand"
	"fmt"
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/gorm-outbox/outbox/relay"
)

// Switching between the Kafka and the Franz publisher must not move a key
// to another partition: both partitioners place many random keys, an empty
// key, pinned and keyless messages alike over many partition counts.
func TestFranzPartitionerMatchesKafka(t *testing.T) {
	t.Parallel()
	sp := newPartitioner("t")
	fp := franzPartitioner{}.ForTopic("t")
	for i := range 2000 {
		key := make([]byte, i%41)
		_, _ = rand.Read(key)
		for _, n := range []int32{1, 2, 3, 6, 12, 16, 50, 101, 256} {
			want, err := sp.Partition(&sarama.ProducerMessage{Key: &gatedEncoder{b: key}, Metadata: &envelope{}}, n)
			require.NoError(t, err)
			rec := &kgo.Record{Key: key, Partition: -1}
			require.True(t, fp.RequiresConsistency(rec), "a keyed record goes among all partitions")
			require.Equal(t, int(want), fp.Partition(rec, int(n)), fmt.Sprintf("key %x, %d partitions", key, n))
		}
	}
	pinned := &kgo.Record{Partition: 4, Context: &franzRec{pinned: true}}
	require.True(t, fp.RequiresConsistency(pinned))
	require.Equal(t, 4, fp.Partition(pinned, 6))
	require.False(t, pinned.Context.(*franzRec).badPart.Load())
	require.Equal(t, 4, fp.Partition(pinned, 3), "out of range: kgo fails it")
	require.True(t, pinned.Context.(*franzRec).badPart.Load())
	keyless := &kgo.Record{Partition: -1}
	require.False(t, fp.RequiresConsistency(keyless), "a keyless record avoids partitions without a leader")
	for range 100 {
		require.Less(t, fp.Partition(keyless, 5), 5)
	}
}

// recordSize counts what sarama counts (recordBytes builds the record).
func TestRecordSizeIsSaramas(t *testing.T) {
	t.Parallel()
	for _, m := range []relay.Message{
		{},
		{Key: []byte("k"), Value: make([]byte, 1000), MessageID: "m-1"},
		{Value: []byte("v"), Headers: []relay.Header{{Key: "a", Value: []byte("b")}, {Key: "traceparent", Value: make([]byte, 55)}}, MessageID: "id"},
		{Key: []byte{}, Headers: []relay.Header{{Key: "n"}}},
	} {
		require.Equal(t, recordBytes(&m, []byte("outbox-id")), recordSize(&m, len("outbox-id")))
	}
}

// Options that break the guarantees are refused.
func TestNewFranzRefusesUnsafeOptions(t *testing.T) {
	t.Parallel()
	for name, opt := range map[string]kgo.Opt{
		"DisableIdempotentWrite":             kgo.DisableIdempotentWrite(),
		"AllowIdempotentProduceCancellation": kgo.AllowIdempotentProduceCancellation(),
		"ManualFlushing":                     kgo.ManualFlushing(),
		"TransactionalID":                    kgo.TransactionalID("x"),
	} {
		_, err := NewFranz(FranzConfig{Brokers: []string{"127.0.0.1:1"}, Options: []kgo.Opt{opt}})
		var ce *relay.ConfigError
		require.ErrorAs(t, err, &ce, name)
		require.Equal(t, "FranzConfig.Options", ce.Field, name)
	}
	_, err := NewFranz(FranzConfig{})
	require.Error(t, err)
	_, err = NewFranz(FranzConfig{Brokers: []string{"127.0.0.1:1"}, MaxMessageBytes: -1})
	require.Error(t, err)
	f, err := NewFranz(FranzConfig{Brokers: []string{"127.0.0.1:1"}, Options: []kgo.Opt{kgo.ProducerLinger(0)}})
	require.NoError(t, err)
	require.NoError(t, f.Close())
}
