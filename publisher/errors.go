package publisher

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/IBM/sarama"
	"github.com/eapache/go-resiliency/breaker"

	"github.com/gorm-outbox/outbox/relay"
)

// ErrClosed is returned by Kafka.Publish after Close was called, wrapped
// with relay.Unavailable (it is not about the messages).
var ErrClosed = errors.New("publisher: closed")

var errClosed = relay.Unavailable(ErrClosed)

// ErrTooLarge is wrapped by the error of a message that is larger than the
// sink accepts, whether the producer rejected it before sending it (the
// record exceeds KafkaConfig.MaxMessageBytes) or the broker did
// (MESSAGE_TOO_LARGE, RECORD_LIST_TOO_LARGE). Such an error is always
// permanent: relay.IsPermanent reports true for it. Use IsTooLarge to test
// for it.
var ErrTooLarge = errors.New("publisher: message too large")

// Error is the error Publish returns for the first message of a batch that
// the sink did not acknowledge. Index is that message's position in the
// batch. For Kafka and Func it equals the acked count Publish returned
// alongside; Transactional acknowledges nothing of a failed batch (acked is
// 0) and Index names the message whose failure aborted the transaction.
//
// Err is the cause. For a cause that retrying cannot fix, Err is a
// *relay.PermanentError, so relay.IsPermanent(err) reports true for the
// *Error too; errors.Is reaches through to the client's error, for example
// sarama.ErrTopicAuthorizationFailed.
type Error struct {
	// Index is the position of the failed message in the batch.
	Index int
	// MessageID is the failed message's relay.Message.MessageID.
	MessageID string
	// Topic is the failed message's topic.
	Topic string
	// Err is the cause.
	Err error
}

func (e *Error) Error() string {
	return fmt.Sprintf("publisher: message %d (id %q, topic %q): %v", e.Index, e.MessageID, e.Topic, e.Err)
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// FailedIndex returns Index. It lets relay.FailedIndex find the failed
// message, so that the relay's failure policy deals with that message.
func (e *Error) FailedIndex() int { return e.Index }

// IsTooLarge reports whether err, or an error it wraps, says that a message
// was too large for the sink (it wraps ErrTooLarge).
func IsTooLarge(err error) bool { return errors.Is(err, ErrTooLarge) }

// permanentKafkaErrors are the broker and client errors that retrying the
// same record cannot fix. They are wrapped with relay.Permanent so that the
// relay's failure policy can dead-letter the message instead of retrying it
// with backoff until MaxAttempts.
//
// Deliberately NOT permanent:
//   - sarama.ErrUnknownTopicOrPartition: Kafka itself calls it retriable. With
//     auto-creation off, the topic may be created by a deploy that is still
//     rolling out; the relay's MaxAttempts still bounds how long a bucket
//     waits for it.
//   - sarama.ErrInvalidMessage (CORRUPT_MESSAGE): a CRC failure on the wire;
//     the Java client retries it.
//   - leadership, timeout, network and out-of-brokers errors: they are
//     relay.Unavailable (see unavailableKafkaErrors).
var permanentKafkaErrors = []error{
	sarama.ErrInvalidTopic,
	sarama.ErrTopicAuthorizationFailed,
	sarama.ErrClusterAuthorizationFailed,
	sarama.ErrInvalidRecord,
	sarama.ErrInvalidTimestamp,
	sarama.ErrInvalidRequiredAcks,
	sarama.ErrUnsupportedForMessageFormat,
	sarama.ErrUnsupportedCompressionType,
	sarama.ErrPolicyViolation,
	// The partitioner chose a partition the topic does not have: a pinned
	// relay.Message.Partition outside the topic's partition count. Adding
	// partitions would fix it, but the relay cannot, so it is permanent.
	sarama.ErrInvalidPartition,
}

// unavailableKafkaErrors are the errors that are not about the message:
// the cluster could not be reached or was not ready to take the write, or
// the producer's state was out of step with the brokers'. They are wrapped
// with relay.Unavailable, so the relay backs off without counting them
// against the message: an outage dead-letters nothing.
var unavailableKafkaErrors = []error{
	sarama.ErrOutOfBrokers,
	sarama.ErrNotConnected,
	sarama.ErrShuttingDown,
	sarama.ErrClosedClient,
	sarama.ErrIncompleteResponse,
	sarama.ErrBrokerNotAvailable,
	sarama.ErrLeaderNotAvailable,
	sarama.ErrNotLeaderForPartition,
	sarama.ErrRequestTimedOut,
	sarama.ErrNotEnoughReplicas,
	sarama.ErrNotEnoughReplicasAfterAppend,
	sarama.ErrKafkaStorageError,
	sarama.ErrNetworkException,
	sarama.ErrNotController,
	sarama.ErrReplicaNotAvailable,
	sarama.ErrFencedLeaderEpoch,
	sarama.ErrUnknownLeaderEpoch,
	sarama.ErrOffsetNotAvailable,
	sarama.ErrThrottlingQuotaExceeded,
	// sarama's partition producer opens a circuit breaker after repeated
	// failed leader lookups and fails messages with it until it closes.
	breaker.ErrBreakerOpen,
	// Connections that fail or break.
	io.EOF,
	io.ErrUnexpectedEOF,
	syscall.ECONNREFUSED,
	syscall.ECONNRESET,
	syscall.EPIPE,
	ErrClosed,
}

// producerStateErrors say that the brokers refused the idempotent
// producer's sequence numbers or epoch: retrying with the same producer
// does not repair it, a new producer (a new producer id) does. They are
// unavailable errors, and the Kafka publisher replaces its producer on
// them.
var producerStateErrors = []error{
	sarama.ErrOutOfOrderSequenceNumber,
	sarama.ErrUnknownProducerID,
	sarama.ErrInvalidProducerEpoch,
	sarama.ErrProducerFenced,
	sarama.ErrInvalidProducerIDMapping,
}

// classify wraps a producer error as ErrTooLarge and/or relay.Permanent,
// or as relay.Unavailable. A too-large error from the broker is also
// relay.BatchRejected: the broker refuses the whole batch of a partition,
// whichever record made it too large.
func classify(err error) error {
	if brokerTooLarge(err) {
		return relay.Permanent(relay.BatchRejected(fmt.Errorf("%w: %w", ErrTooLarge, err)))
	}
	if clientTooLarge(err) {
		return relay.Permanent(fmt.Errorf("%w: %w", ErrTooLarge, err))
	}
	for _, perm := range permanentKafkaErrors {
		if errors.Is(err, perm) {
			return relay.Permanent(err)
		}
	}
	if relay.IsUnavailable(err) {
		return err // already marked: do not mark it twice
	}
	if isUnavailable(err) {
		return relay.Unavailable(err)
	}
	return err
}

func isUnavailable(err error) bool {
	if relay.IsUnavailable(err) || isProducerState(err) {
		return true
	}
	for _, e := range unavailableKafkaErrors {
		if errors.Is(err, e) {
			return true
		}
	}
	var ne net.Error
	return errors.As(err, &ne)
}

func brokerTooLarge(err error) bool {
	return errors.Is(err, sarama.ErrMessageSizeTooLarge) || errors.Is(err, sarama.ErrMessageSetSizeTooLarge)
}

// clientTooLarge: sarama rejects a record larger than
// Producer.MaxMessageBytes before sending it, with a ConfigurationError
// whose text is the only distinguishing mark: "Attempt to produce message
// larger than configured Producer.MaxMessageBytes: %d > %d".
func clientTooLarge(err error) bool {
	var ce sarama.ConfigurationError
	return errors.As(err, &ce) && strings.Contains(string(ce), "MaxMessageBytes")
}
