package publisher_test

import (
	"context"
	"fmt"

	"github.com/gorm-outbox/outbox/publisher"
	"github.com/gorm-outbox/outbox/relay"
)

func ExampleFunc() {
	p := publisher.Func(func(ctx context.Context, m relay.Message) error {
		if len(m.Value) == 0 {
			return relay.Permanent(fmt.Errorf("empty payload"))
		}
		fmt.Printf("delivered %s to %s\n", m.MessageID, m.Topic)
		return nil
	})

	acked, err := p.Publish(context.Background(), []relay.Message{
		{MessageID: "a", Topic: "orders", Value: []byte("{}")},
		{MessageID: "b", Topic: "orders"},
		{MessageID: "c", Topic: "orders", Value: []byte("{}")},
	})
	fmt.Println(acked, err, relay.IsPermanent(err))
	// Output:
	// delivered a to orders
	// 1 publish refused (permanent: the relay does not retry it); topic orders; message id "b"; sink error: permanent: empty payload true
}

func ExampleKeyPartition() {
	// Where the Java client's default partitioner puts a key on a topic
	// with 12 partitions; the Kafka publisher places keys the same way.
	fmt.Println(publisher.KeyPartition([]byte("order-42"), 12))
	fmt.Println(publisher.KeyPartition([]byte{}, 12)) // the empty key is a key
	// Output:
	// 0
	// 9
}
