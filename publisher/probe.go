package publisher

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"

	"github.com/gorm-outbox/outbox/relay"
)

var (
	_ relay.SinkProber = (*Kafka)(nil)
	_ relay.SinkProber = (*Transactional)(nil)
)

// ProbeSink implements relay.SinkProber: it opens a new connection to
// each of KafkaConfig.Brokers in turn and returns nil at the first that
// answers an ApiVersions request (see probeBrokers). It uses none of the
// producers' connections or cached metadata, so it fails while no broker
// answers and succeeds once one does. It works before Start and after
// Stop, and logs nothing.
func (k *Kafka) ProbeSink(ctx context.Context) error { return probeBrokers(ctx, k.brokers, k.sc) }

// ProbeSink implements relay.SinkProber as Kafka.ProbeSink does.
func (t *Transactional) ProbeSink(ctx context.Context) error {
	return probeBrokers(ctx, t.cfg.Brokers, t.pingCfg)
}

// errNoBrokerAnswers is probeBrokers' error when every broker failed.
var errNoBrokerAnswers = errors.New("publisher: no Kafka broker answers")

// probeBrokers connects to each of brokers in turn, with sc's network
// settings (TLS, SASL, client id) and its timeouts cut to ctx's deadline,
// and returns nil at the first that answers an ApiVersions request: a
// new TCP connection (and TLS and SASL handshakes, when configured) and
// one round trip, then the connection is closed. It reports why each
// failed otherwise, or ctx's error.
func probeBrokers(ctx context.Context, brokers []string, sc *sarama.Config) error {
	conf := *sc
	if d, ok := ctx.Deadline(); ok {
		left := max(time.Until(d), time.Millisecond)
		conf.Net.DialTimeout = min(conf.Net.DialTimeout, left)
		conf.Net.ReadTimeout = min(conf.Net.ReadTimeout, left)
		conf.Net.WriteTimeout = min(conf.Net.WriteTimeout, left)
	}
	errs := []error{errNoBrokerAnswers}
	for _, addr := range brokers {
		if err := ctx.Err(); err != nil {
			return err
		}
		err := probeBroker(addr, &conf)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", addr, err))
	}
	return errors.Join(errs...)
}

// probeBroker asks the broker at addr for its API versions over a new
// connection, which it closes.
func probeBroker(addr string, conf *sarama.Config) error {
	b := sarama.NewBroker(addr)
	if err := b.Open(conf); err != nil {
		return err
	}
	defer func() { _ = b.Close() }()
	if ok, err := b.Connected(); !ok || err != nil {
		if err == nil {
			err = sarama.ErrNotConnected
		}
		return err
	}
	_, err := b.ApiVersions(&sarama.ApiVersionsRequest{})
	return err
}
