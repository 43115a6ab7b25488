package outbox

import "errors"

// Limits are a sink's rules for the messages it can take, checked at
// Enqueue and by publish rules in the writer's transaction, so a message
// the sink would refuse is never committed. Config.Limits defaults to
// KafkaLimits; a relay publishing to another sink gives the plugin that
// sink's Limits.
type Limits interface {
	// CheckTopic returns nil if the sink accepts topic, else an error
	// saying why not. Enqueue reports it as a *MessageError for the
	// field "Topic" (the error itself when it is one).
	CheckTopic(topic string) error
	// Size is the number of bytes of m that count against
	// Config.MaxMessageBytes.
	Size(m *Message) int
}

// KafkaLimits are Kafka's rules, the default Limits: topic names of 1 to
// 249 characters of [a-zA-Z0-9._-], neither "." nor ".." (ValidateTopic),
// and sizes counted as the Kafka producer counts the record the publisher
// makes of a message (Message.Size).
type KafkaLimits struct{}

// CheckTopic implements Limits with ValidateTopic.
func (KafkaLimits) CheckTopic(topic string) error { return ValidateTopic(topic) }

// Size implements Limits with Message.Size.
func (KafkaLimits) Size(m *Message) int { return m.Size() }

// checkTopic asks limits about topic and reports a refusal as a
// *MessageError.
func checkTopic(limits Limits, topic string) error {
	err := limits.CheckTopic(topic)
	if err == nil {
		return nil
	}
	if me := (*MessageError)(nil); errors.As(err, &me) {
		return err
	}
	return &MessageError{Field: "Topic", Topic: topic, Reason: err.Error()}
}

var _ Limits = KafkaLimits{}
