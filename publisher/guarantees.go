package publisher

import (
	"strconv"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox/relay"
)

// guaranteedConfig builds the sarama configuration of both Kafka
// publishers, in one place so that they cannot drift: sarama's defaults,
// the client id, the user's Configure hook, then the settings the
// publishers' guarantees depend on, overriding whatever the hook set:
//
//   - Producer.RequiredAcks = sarama.WaitForAll (acks=all);
//   - Producer.Idempotent = true and Net.MaxOpenRequests = 1, so that
//     retries neither duplicate nor reorder records;
//   - Producer.Retry.Max raised to RetryMaxDefault if below 1;
//   - Version raised to MinKafkaVersion if below it;
//   - Producer.Return.Successes and Producer.Return.Errors = true;
//   - Producer.Partitioner: pinned partition, else the Java client's
//     murmur2 key hash, else random for nil keys;
//   - Producer.MaxMessageBytes = maxMessageBytes;
//   - Producer.Transaction.ID = txnID (empty: not transactional).
//
// configName names the publisher's configuration type in errors
// ("KafkaConfig", "TransactionalConfig"); txnIDReason says why the hook
// must leave Producer.Transaction.ID empty.
func guaranteedConfig(configName string, configure func(*sarama.Config) error, maxMessageBytes int, txnID, txnIDReason string) (*sarama.Config, error) {
	sc := sarama.NewConfig()
	sc.ClientID = ClientIDDefault
	if configure != nil {
		if err := configure(sc); err != nil {
			return nil, configError(configName+".Configure", "func", "the hook failed", err)
		}
	}
	if sc.Producer.Transaction.ID != "" {
		return nil, configError(configName+".Configure", "func", "sets sarama Producer.Transaction.ID, which must stay empty: "+txnIDReason, nil)
	}

	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	if sc.Producer.Retry.Max < 1 {
		sc.Producer.Retry.Max = RetryMaxDefault
	}
	if !sc.Version.IsAtLeast(MinKafkaVersion) {
		sc.Version = MinKafkaVersion
	}
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Partitioner = newPartitioner
	sc.Producer.MaxMessageBytes = maxMessageBytes
	sc.Producer.Transaction.ID = txnID

	if err := sc.Validate(); err != nil {
		return nil, configError(configName+".Configure", "func", "leaves an invalid sarama configuration", err)
	}
	return sc, nil
}

// checkMaxMessageBytes validates the MaxMessageBytes field of a publisher
// configuration.
func checkMaxMessageBytes(configName string, n int) error {
	if n <= 0 || n >= int(sarama.MaxRequestSize) {
		return configError(configName+".MaxMessageBytes", n, "must be between 1 and "+strconv.Itoa(int(sarama.MaxRequestSize)-1), nil)
	}
	return nil
}

// checkBrokers validates the Brokers field of a publisher configuration.
func checkBrokers(configName string, brokers []string) error {
	if len(brokers) == 0 {
		return configError(configName+".Brokers", brokers, "must name at least one broker", nil)
	}
	return nil
}

// configError is the publisher's *relay.ConfigError.
func configError(field string, value any, reason string, err error) error {
	return &relay.ConfigError{Package: "publisher", Field: field, Value: value, Reason: reason, Err: err}
}
