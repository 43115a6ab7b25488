package wire

// Header is one record header. Order is kept and duplicate names are
// allowed, as in Kafka itself.
type Header struct {
	Key   string
	Value []byte
}
