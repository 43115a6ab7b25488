package inbox

import (
	"errors"
	"log/slog"

	"github.com/IBM/sarama"
)

// ConsumerGroupHandler adapts an Inbox and a Handler to sarama's
// consumer groups. Each claimed record goes through Inbox.Handle; its
// offset is marked only after that returned: after the transaction that
// recorded the id committed, or after the id was found already recorded.
// So a crash between the commit and the offset commit redelivers a record
// the inbox then skips, and a record whose transaction did not commit is
// never marked.
//
// On a failing handler or database the record is retried with backoff
// (Config.RetryMin to RetryMax) within the claim, keeping the
// partition's order: later records of the partition wait. The retries
// end when the session ends (rebalance, Close, the ctx given to Consume):
// the record is then left unmarked for the partition's next owner. A
// record without a usable message id (and Config.AllowMissingID unset)
// ends ConsumeClaim with its *MessageIDError, unmarked, which ends the
// session: sarama reports the error on ConsumerGroup.Errors when
// Consumer.Return.Errors is set, and Consume returns so the caller
// decides.
//
// With the cooperative-sticky strategy a revoked partition is noticed
// when its record channel closes, so a record that keeps failing
// holds a revoked claim until Consumer.Group.Rebalance.Timeout, after
// which sarama ends the session.
type ConsumerGroupHandler struct {
	inbox   *Inbox
	handler Handler
}

var _ sarama.ConsumerGroupHandler = (*ConsumerGroupHandler)(nil)

// ConsumerGroupHandler returns the sarama adapter of h:
//
//	for ctx.Err() == nil {
//		if err := group.Consume(ctx, topics, ib.ConsumerGroupHandler(h)); err != nil { ... }
//	}
func (i *Inbox) ConsumerGroupHandler(h Handler) *ConsumerGroupHandler {
	return &ConsumerGroupHandler{inbox: i, handler: h}
}

// Setup implements sarama.ConsumerGroupHandler; it does nothing.
func (*ConsumerGroupHandler) Setup(sarama.ConsumerGroupSession) error { return nil }

// Cleanup implements sarama.ConsumerGroupHandler; it does nothing.
func (*ConsumerGroupHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// ConsumeClaim implements sarama.ConsumerGroupHandler: every record of
// the claim through Inbox.Handle, then its offset marked.
func (c *ConsumerGroupHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	ctx := sess.Context()
	for {
		select {
		case <-ctx.Done():
			return nil
		case msg, ok := <-claim.Messages():
			if !ok {
				return nil
			}
			if _, err := c.inbox.Handle(ctx, FromSarama(msg), c.handler); err != nil {
				if errors.Is(err, ErrNoMessageID) {
					c.inbox.log.Error("inbox: record without a usable message id; stopping the claim",
						slog.String("topic", msg.Topic), slog.Int("partition", int(msg.Partition)),
						slog.Int64("offset", msg.Offset), slog.Any("error", err))
					return err
				}
				return nil // the session ended: leave the record to the next owner
			}
			sess.MarkMessage(msg, "")
		}
	}
}
