// Package devbroker runs an in-process Kafka-protocol broker (kfake) as a
// standalone server, for benchmarks and demos that need the broker in a
// process of its own.
package devbroker

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Options configure Run.
type Options struct {
	// Port to listen on, on 127.0.0.1; 0 picks a free one.
	Port int
	// Topics to create, each with Partitions partitions.
	Topics     []string
	Partitions int32
	// Blackhole makes the broker acknowledge produced records without
	// keeping them: a benchmark that only produces need not fill memory.
	Blackhole bool
}

// Run starts the broker, writes "BROKER <host:port>" on a line to w once it
// listens, and serves until ctx is done.
func Run(ctx context.Context, o Options, w io.Writer) error {
	if o.Partitions <= 0 {
		o.Partitions = 8
	}
	opts := []kfake.Opt{kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(int(o.Partitions))}
	if o.Port != 0 {
		opts = append(opts, kfake.Ports(o.Port))
	}
	if len(o.Topics) > 0 {
		opts = append(opts, kfake.SeedTopics(o.Partitions, o.Topics...))
	}
	if o.Blackhole {
		opts = append(opts, kfake.BlackholeProduce())
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return fmt.Errorf("devbroker: start: %w", err)
	}
	defer c.Close()
	fmt.Fprintf(w, "BROKER %s\n", strings.Join(c.ListenAddrs(), ","))
	<-ctx.Done()
	return nil
}
