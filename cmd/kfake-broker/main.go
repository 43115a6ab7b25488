// Command kfake-broker runs a Kafka-protocol broker (franz-go's kfake) on
// a loopback port until it is interrupted. It is a development and
// benchmark aid, not a Kafka server: it keeps everything in memory.
// Besides the -topics it creates at start, it creates a topic the first
// time a client asks for it in a metadata request that allows
// auto-creation (sarama's producer, and so the publisher, sends those),
// with -partitions partitions; outboxtest.NewBroker creates only the topics it is given.
//
//	go run ./cmd/kfake-broker -port 9092 -topics orders -partitions 8
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/gorm-outbox/outbox/internal/devbroker"
)

func main() {
	var o devbroker.Options
	var topics string
	var partitions int
	flag.IntVar(&o.Port, "port", 9092, "port on 127.0.0.1 (0: any free port)")
	flag.StringVar(&topics, "topics", "", "comma-separated topics to create")
	flag.IntVar(&partitions, "partitions", 8, "partitions per topic")
	flag.BoolVar(&o.Blackhole, "blackhole", false, "acknowledge records without keeping them")
	flag.Parse()
	if topics != "" {
		o.Topics = strings.Split(topics, ",")
	}
	o.Partitions = int32(partitions)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := devbroker.Run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
