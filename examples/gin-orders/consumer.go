package main

import (
	"log/slog"
	"sync"

	"github.com/IBM/sarama"
)

// MessageIDHeader is the header the outbox stamps on every record; the
// same id on every delivery attempt.
const MessageIDHeader = "x-outbox-message-id"

// Consumer is the consumer side every user of an at-least-once outbox
// writes once: it reads every partition and skips a record whose message
// id it has already processed. A real service keeps the processed ids in
// its own database, in the transaction that applies the event.
type Consumer struct {
	consumer   sarama.Consumer
	partitions []sarama.PartitionConsumer
	log        *slog.Logger
	wg         sync.WaitGroup

	mu   sync.Mutex
	seen map[string]bool
}

// StartConsumer consumes topic from the oldest offset of every partition.
func StartConsumer(brokers []string, topic string, log *slog.Logger) (*Consumer, error) {
	cfg := sarama.NewConfig()
	cfg.ClientID = "gin-orders-consumer"
	cfg.Consumer.Return.Errors = false
	sc, err := sarama.NewConsumer(brokers, cfg)
	if err != nil {
		return nil, err
	}
	parts, err := sc.Partitions(topic)
	if err != nil {
		sc.Close()
		return nil, err
	}
	c := &Consumer{consumer: sc, log: log, seen: map[string]bool{}}
	for _, p := range parts {
		pc, err := sc.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.partitions = append(c.partitions, pc)
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			for m := range pc.Messages() {
				c.handle(m)
			}
		}()
	}
	return c, nil
}

func (c *Consumer) handle(m *sarama.ConsumerMessage) {
	id, eventType := "", ""
	for _, h := range m.Headers {
		switch string(h.Key) {
		case MessageIDHeader:
			id = string(h.Value)
		case "event-type":
			eventType = string(h.Value)
		}
	}
	c.mu.Lock()
	dup := c.seen[id]
	c.seen[id] = true
	c.mu.Unlock()
	if dup {
		c.log.Info("consumer skipped a duplicate", slog.String("message_id", id))
		return
	}
	c.log.Info("consumer received event",
		slog.String("event_type", eventType), slog.String("key", string(m.Key)),
		slog.Int("partition", int(m.Partition)), slog.Int64("offset", m.Offset),
		slog.String("message_id", id))
}

// Close stops consuming. sarama's Consumer.Close waits until every
// partition consumer is closed, so those are closed first: AsyncClose ends
// each Messages channel once the records already fetched were handed over,
// which ends the goroutines reading them.
func (c *Consumer) Close() {
	for _, pc := range c.partitions {
		pc.AsyncClose()
	}
	c.wg.Wait()
	if err := c.consumer.Close(); err != nil {
		c.log.Warn("consumer close", slog.Any("error", err))
	}
}
