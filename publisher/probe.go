package publisher

import (
	"context"
	"errors"
	"fmt"
	"sync"
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
// Stop, and logs no failure.
//
// When a broker answers after a probe failed, every producer whose
// publishes have failed since before that failed probe, with no
// acknowledgement since, is replaced first (ReplaceBrokersBack), and
// ProbeSink returns once the replacements are done or ctx ends: after an
// outage, sarama's circuit breakers of the producer's topics and
// partitions are open and would fail its publishes for up to 10s more,
// while a new producer publishes at once. A producer is so replaced once
// per outage: failures while every probe answers (partitions without a
// leader on brokers that are up) replace nothing here. A producer failing
// only on unknown topics or messages refused for good is not failing.
func (k *Kafka) ProbeSink(ctx context.Context) error {
	if err := probeBrokers(ctx, k.brokers, k.sc); err != nil {
		if ctx.Err() == nil {
			k.probeFailed.Store(time.Now().UnixNano())
		}
		return err
	}
	k.replaceFailing(ctx)
	return nil
}

// replaceFailing replaces every producer that has failed, without an
// acknowledgement, since before the last failed probe, and waits for the
// replacements or the end of ctx.
func (k *Kafka) replaceFailing(ctx context.Context) {
	last := k.probeFailed.Load()
	if last == 0 {
		return
	}
	down := time.Unix(0, last)
	type failing struct {
		slot, lane int
		failingFor time.Duration
	}
	now := time.Now()
	var fs []failing
	k.mu.Lock()
	if !k.closed {
		for i := range k.slots {
			for l := range k.lanes {
				h := &k.slots[i].lanes[l].health
				if h.failingSince.IsZero() || h.failingSince.After(down) || h.replacing {
					continue
				}
				h.replacing, h.lastReplace = true, now
				fs = append(fs, failing{i, l, now.Sub(h.failingSince)})
				k.retired.Add(1)
			}
		}
	}
	k.mu.Unlock()
	if len(fs) == 0 {
		return
	}
	var wg sync.WaitGroup
	for _, f := range fs {
		wg.Go(func() { k.replace(f.slot, f.lane, ReplaceBrokersBack, errBrokersBack, f.failingFor, -1) })
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done(): // the replacements go on; Close waits for them
	}
}

// errBrokersBack is the cause logged with a ReplaceBrokersBack
// replacement.
var errBrokersBack = errors.New("a broker answered a probe while the producer's publishes failed")

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
	return probeEach(ctx, brokers, func(addr string) error { return probeBroker(addr, &conf) })
}

// probeEach runs probe on each of brokers in turn and returns nil at the
// first that succeeds; otherwise errNoBrokerAnswers joined with why each
// failed, or ctx's error.
func probeEach(ctx context.Context, brokers []string, probe func(addr string) error) error {
	errs := []error{errNoBrokerAnswers}
	for _, addr := range brokers {
		if err := ctx.Err(); err != nil {
			return err
		}
		err := probe(addr)
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
