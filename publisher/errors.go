package publisher

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"unicode/utf8"

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
// the sink did not acknowledge. It names the message by its id, topic and
// key; Index, its position in the batch, is only there for the relay (see
// FailedIndex). For Kafka and Func Index equals the acked count Publish
// returned alongside; Transactional acknowledges nothing of a failed batch
// (acked is 0) and Index names the message whose failure aborted the
// transaction.
//
// Err is the cause. For a cause that retrying cannot fix, Err is a
// *relay.PermanentError, so relay.IsPermanent(err) reports true for the
// *Error too; errors.Is reaches through to the client's error, for example
// sarama.ErrTopicAuthorizationFailed.
//
// Error() puts the cause first in plain words with its numbers, then
// where (topic, partition, message id, key), then the client's own text:
//
//	record too large: 1,234,567 bytes, limit 1,000,000 (Producer.MaxMessageBytes); topic orders, partition 3; message id "m-1", key "order-42"; sink error: publisher: message too large: kafka: invalid configuration (...)
type Error struct {
	// Index is the position of the failed message in the batch.
	Index int
	// MessageID is the failed message's relay.Message.MessageID.
	MessageID string
	// Topic is the failed message's topic.
	Topic string
	// Key is the failed message's key; nil for a keyless message.
	Key []byte
	// Partition is the partition the message was sent to, nil when it was
	// not chosen yet (the producer refused the record before partitioning
	// it).
	Partition *int32
	// Size is the record's size in bytes as the producer counts it against
	// its MaxMessageBytes, and Limit that MaxMessageBytes; both are set
	// when the message was too large (IsTooLarge), 0 otherwise.
	Size, Limit int
	// MaybeWritten reports that the failed message may have been written
	// to Kafka although it was reported failed: the produce request went
	// out and its answer was lost (a timeout, a broken connection), so a
	// consumer may see this copy and the one the relay publishes next.
	MaybeWritten bool
	// LaterMaybeWritten are the MessageIDs of later messages of the batch
	// that the brokers acknowledged, or whose outcome is unknown, although
	// they are not in the acknowledged prefix: the relay publishes them
	// again, and a consumer may already have them. Kafka only; empty for
	// Transactional (a failed transaction is aborted).
	LaterMaybeWritten []string
	// Err is the cause.
	Err error
}

func (e *Error) Error() string {
	var sb strings.Builder
	sb.WriteString(e.Cause())
	sb.WriteString("; topic ")
	if e.Topic == "" {
		sb.WriteString("(none)")
	} else {
		sb.WriteString(e.Topic)
	}
	if e.Partition != nil {
		sb.WriteString(", partition ")
		sb.WriteString(strconv.Itoa(int(*e.Partition)))
	}
	sb.WriteString("; message id ")
	sb.WriteString(strconv.Quote(e.MessageID))
	if e.Key != nil {
		sb.WriteString(", key ")
		sb.WriteString(quoteKey(e.Key))
	}
	sb.WriteString("; sink error: ")
	if e.Err == nil {
		sb.WriteString("unknown")
	} else {
		sb.WriteString(e.Err.Error())
	}
	return sb.String()
}

// Cause says in plain words, with its numbers, why the message failed:
// the first part of Error() without the message's coordinates and the
// client's text. It recognizes a record too large for the producer
// (Producer.MaxMessageBytes) or for the broker (MESSAGE_TOO_LARGE), a
// missing, invalid or unknown topic, a partition the topic does not have,
// a refused authorization, and otherwise says whether the relay retries.
func (e *Error) Cause() string {
	err := e.Err
	switch {
	case clientTooLarge(err) || (IsTooLarge(err) && !brokerTooLarge(err)):
		size, limit := e.Size, e.Limit
		if size == 0 || limit == 0 {
			size, limit = clientSizes(err)
		}
		if size > 0 && limit > 0 {
			return "record too large: " + groupDigits(size) + " bytes, limit " + groupDigits(limit) + " (Producer.MaxMessageBytes)"
		}
		return "record too large for the producer (Producer.MaxMessageBytes)"
	case brokerTooLarge(err):
		s := "record too large for the broker (MESSAGE_TOO_LARGE): the broker refused the record batch it travelled in"
		if e.Size > 0 {
			s += "; the record is " + groupDigits(e.Size) + " bytes"
			if e.Limit > 0 {
				s += ", the producer's limit " + groupDigits(e.Limit) + " (Producer.MaxMessageBytes)"
			}
		}
		return s + "; the topic's max.message.bytes (or the broker's message.max.bytes) is lower"
	case errors.Is(err, errNoTopic):
		return "message has no topic"
	case errors.Is(err, sarama.ErrInvalidTopic):
		return "invalid topic name " + strconv.Quote(e.Topic) + ": Kafka topic names are 1 to 249 characters of a-z, A-Z, 0-9, '.', '_' and '-'"
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		return "unknown topic " + strconv.Quote(e.Topic) + ": the cluster has no such topic (or partition); create it, or enable auto.create.topics.enable"
	case errors.Is(err, sarama.ErrInvalidPartition):
		return "partition does not exist in topic " + strconv.Quote(e.Topic) + " (a pinned partition beyond its partition count, or negative)"
	case errors.Is(err, sarama.ErrTopicAuthorizationFailed):
		return "not authorized to write to topic " + strconv.Quote(e.Topic)
	case errors.Is(err, sarama.ErrClusterAuthorizationFailed):
		return "not authorized by the cluster (idempotent or transactional writes need the cluster IdempotentWrite permission)"
	case relay.IsPermanent(err):
		return "publish refused (permanent: the relay does not retry it)"
	case relay.IsUnavailable(err):
		return "publish failed: Kafka was unavailable (the relay retries it)"
	}
	return "publish failed (the relay retries it)"
}

// clientSizes reads the record size and the limit out of sarama's
// "Attempt to produce message larger than configured
// Producer.MaxMessageBytes: %d > %d", or returns zeros.
func clientSizes(err error) (size, limit int) {
	var ce sarama.ConfigurationError
	if !errors.As(err, &ce) {
		return 0, 0
	}
	s := string(ce)
	i := strings.LastIndex(s, ": ")
	if i < 0 {
		return 0, 0
	}
	if _, err := fmt.Sscanf(s[i+2:], "%d > %d", &size, &limit); err != nil {
		return 0, 0
	}
	return size, limit
}

// groupDigits writes n with a comma every three digits: 1,234,567.
func groupDigits(n int) string {
	s := strconv.Itoa(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var sb strings.Builder
	if neg {
		sb.WriteByte('-')
	}
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			sb.WriteByte(',')
		}
		sb.WriteRune(c)
	}
	return sb.String()
}

// keyShown is how many bytes of a key an error quotes.
const keyShown = 64

// quoteKey quotes a key for an error: Go-quoted text, cut at keyShown
// bytes (on a rune boundary) with its full length after it.
func quoteKey(k []byte) string {
	if len(k) <= keyShown {
		return strconv.Quote(string(k))
	}
	n := keyShown
	for n > 0 && !utf8.RuneStart(k[n]) {
		n--
	}
	return strconv.Quote(string(k[:n])) + "... (" + groupDigits(len(k)) + " bytes)"
}

// outcomeUnknown reports whether a producer error leaves open whether the
// record was written: the request went out and its answer did not come
// back (a timeout, a connection broken mid-request), or the leader wrote
// it but too few replicas followed.
func outcomeUnknown(err error) bool {
	for _, e := range []error{
		sarama.ErrRequestTimedOut, sarama.ErrNotEnoughReplicasAfterAppend, sarama.ErrIncompleteResponse,
		sarama.ErrNetworkException, io.EOF, io.ErrUnexpectedEOF, syscall.ECONNRESET, syscall.EPIPE,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// MaybeWrittenIDs returns MaybeWritten and LaterMaybeWritten: whether the
// failed message, and which later messages of the batch, may have been
// written although they were not acknowledged. The relay's GORM store
// reads it to note on those messages that a copy may already have been
// delivered.
func (e *Error) MaybeWrittenIDs() (failed bool, later []string) {
	return e.MaybeWritten, e.LaterMaybeWritten
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

// errTopicBreaker says why a message failed with the circuit breaker of
// its topic open: the breaker opened on the topic's own failures.
var errTopicBreaker = errors.New("sarama's circuit breaker for the topic is open after repeated failed lookups of it")

// unknownTopics remembers the topics whose last failure was
// UNKNOWN_TOPIC_OR_PARTITION, so that the failures that follow them
// count against their messages.
//
// sarama looks a topic's partitions up under a circuit breaker of the
// topic (3 failures open it for 10s, then one lookup is let through): after
// three unknown-topic failures its messages fail with breaker.ErrBreakerOpen,
// which alone says nothing about the message and is relay.Unavailable. For
// a topic whose last failure was an unknown topic the breaker is open
// because of that topic: classify returns the failure as what it is, an
// unknown topic (transient, counted by the relay's MaxAttempts), so that
// MaxAttempts bounds the wait for a missing topic as documented. Any other
// failure of the topic (brokers unreachable while looking it up, a
// leader lookup failing) forgets it: a breaker that opens then is an
// outage.
type unknownTopics struct{ m sync.Map } // topic → struct{}

// classify is classify(err) for a message of topic, with the topic's
// breaker attributed as above.
func (u *unknownTopics) classify(topic string, err error) error {
	switch {
	case errors.Is(err, sarama.ErrUnknownTopicOrPartition):
		u.m.Store(topic, struct{}{})
	case errors.Is(err, breaker.ErrBreakerOpen):
		if _, ok := u.m.Load(topic); ok {
			return fmt.Errorf("%w: %w: %w", sarama.ErrUnknownTopicOrPartition, errTopicBreaker, err)
		}
	default:
		u.m.Delete(topic)
	}
	return classify(err)
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
